"""fedssl: label-efficient federated self-supervised learning for medical imaging, as NVIDIA FLARE jobs."""
__version__ = "0.1.0"
