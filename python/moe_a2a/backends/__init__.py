"""Device backends of AllToAll: the same protocol run by C++ loops (cpu) or kernels (cuda).

A backend receives validated, contiguous tensors and drives one `_core`
implementation; the front end (`moe_a2a.all_to_all.AllToAll`) owns the
contract, validation and call order.
"""
