"""Rotation of rotation-ready residual streams by orthogonal (Hadamard) matrices."""
