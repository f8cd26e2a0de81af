"""Encode/decode of the codec's wire: public ops, Triton kernels, references.

ops             encode, decode: Triton kernels on CUDA, the jnp reference elsewhere
reference       pure-jnp encode/decode built from bits, detect and payload
triton_src      @triton.jit kernels and their launch plans (imports triton, not jax)
host_reference  numpy encode/decode, the oracle of the Triton interpreter tests (no jax)
geometry        static sizes of a shard's wire from plain ints (no jax)
"""
from moejax.codec.kernels.ops import Encoded
from moejax.codec.kernels.ops import decode
from moejax.codec.kernels.ops import encode

__all__ = ["Encoded", "decode", "encode"]
