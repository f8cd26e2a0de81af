"""Lossless exponent-reuse all-gather.

bits     exponent vs sign+mantissa split/merge, dense bit packing
detect   changed blocks/values: exact comparison or two SplitMix64 hashes per block; change
         counts of every mode for one shard
payload  static-shape exponent patches (block bitmap + blocks, or positions + exponents)
word     static-shape whole-word patches (bitmap + changed values), and delta codes
replicas fssdp's expert replicas as delta patches against what a device held last step
gather   CodecSpec, init_state, compressed_all_gather (custom_vjp), invalidate, same_state
select   which parameters use it, in which mode: gain vs cost under a cache-memory budget
kernels  encode/decode of the exponent modes: Triton on GPU, jnp reference elsewhere
"""
from moejax.codec.gather import CodecSpec
from moejax.codec.gather import compressed_all_gather
from moejax.codec.gather import init_state
from moejax.codec.gather import invalidate
from moejax.codec.gather import same_state
from moejax.codec.gather import state_bytes
from moejax.codec.gather import wire_bytes

__all__ = ["CodecSpec", "compressed_all_gather", "init_state", "invalidate", "same_state",
           "state_bytes", "wire_bytes"]
