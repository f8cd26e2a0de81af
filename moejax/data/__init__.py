"""Data: document sources, tokenizers, and a resumable batch iterator.

`make_data(DataSpec(...), batch_size=B, seq_len=S)` is the entry point; see pipeline.py.
"""
from moejax.data.pipeline import Data, DataSpec, make_data
from moejax.data.sources import load_documents
from moejax.data.tokenizer import ByteTokenizer, HFTokenizer, check_vocab, load_tokenizer

__all__ = [
    "ByteTokenizer", "Data", "DataSpec", "HFTokenizer", "check_vocab", "load_documents",
    "load_tokenizer", "make_data",
]
