"""Shared pytest configuration: keep unit tests single-threaded so they are fast and reproducible."""

import torch

torch.set_num_threads(1)
