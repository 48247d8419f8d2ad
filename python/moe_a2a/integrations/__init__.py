"""Adapters that let training frameworks use moe-a2a's differentiable dispatch and combine."""
