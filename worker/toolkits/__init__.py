"""CUDA toolkits: provisioned from NVIDIA's wheels or its redistributable archives, and advertised
only when proven.
"""
