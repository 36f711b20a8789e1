"""Input data: tokenizers, synthetic long-context tasks, packed local text, the grain pipeline."""

from orthros_jax.data.pipeline import example_arrays, make_dataset, make_iterator, synthetic_arrays
from orthros_jax.data.synthetic import TASKS, Example, TaskMixture, filler, mqar, parse_mqar, passkey
from orthros_jax.data.text import find_files, load_packed, pack_tokens, read_documents
from orthros_jax.data.tokenizers import ByteTokenizer, HFTokenizer, Tokenizer, get_tokenizer

__all__ = [
    'ByteTokenizer', 'Example', 'HFTokenizer', 'TASKS', 'TaskMixture',
    'Tokenizer', 'example_arrays', 'filler', 'find_files', 'get_tokenizer',
    'load_packed', 'make_dataset', 'make_iterator', 'mqar', 'pack_tokens',
    'parse_mqar', 'passkey', 'read_documents', 'synthetic_arrays',
]
