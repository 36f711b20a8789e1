"""Input data: tokenizers, synthetic long-context tasks, packed local text, the grain pipeline."""

from orthros_jax.data.pipeline import example_arrays, make_dataset, make_iterator, synthetic_arrays
from orthros_jax.data.synthetic import TASKS, Example, TaskMixture, filler, mqar, parse_mqar, passkey
from orthros_jax.data.text import find_files, load_packed, pack_tokens, read_documents
from orthros_jax.data.tokenizers import ByteTokenizer, HFTokenizer, Tokenizer, get_tokenizer
