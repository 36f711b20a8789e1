"""Chat with a model in the terminal: streamed replies, time to first token
per turn, every turn a continued prefill onto the conversation's cache
(orthros_jax/chat.py).

  make smollm2                          # the teacher, offline
  python chat.py --teacher=results/smollm2/hf \
      --adapter=assets/smollm2_orthros --attention=orthros
  python chat.py --teacher=results/smollm2/hf --attention=dense
  python chat.py --model=results/smollm2_orthros_model   # an exported model

--attention=dense is the teacher as loaded; orthros applies --adapter (the
converted model); --model is a directory written by
`python -m orthros_jax.checkpoints.export` (its own attention, tokenizer
files beside it). Type a message and Enter; an empty line or Ctrl-D ends.
--prompt (repeatable) runs those turns and exits instead of reading stdin.
--verbosity=0 shows the libraries' INFO lines (orthros_jax/console.py).
"""

import sys

from absl import app
from absl import flags

from orthros_jax import console

_MODEL = flags.DEFINE_string('model', None, 'An exported model directory '
                             '(orthros_jax/checkpoints/export.py), instead '
                             'of --teacher / --adapter.')
_TEACHER = flags.DEFINE_string('teacher', None, 'The dense model: a local '
                               'Hugging Face directory (make smollm2) or a '
                               'train.py checkpoint.')
_ADAPTER = flags.DEFINE_string('adapter', None, 'Orthros adapter directory '
                               '(convert.py), for --attention=orthros.')
_ATTENTION = flags.DEFINE_enum('attention', 'orthros', ['dense', 'orthros'],
                               'dense: the teacher as loaded; orthros: the '
                               'adapter applied to it.')
_TOKENIZER = flags.DEFINE_string('tokenizer', None, 'tokenizer.json or its '
                                 'directory (default: --teacher).')
_PROMPT = flags.DEFINE_multi_string('prompt', [], 'User turns to run in '
                                    'order instead of reading stdin.')
_SYSTEM = flags.DEFINE_string('system', None, 'A system message.')
_MAX_NEW = flags.DEFINE_integer('max_new_tokens', 256, 'Reply budget per '
                                'turn.')
_MAX_LEN = flags.DEFINE_integer('max_len', 4096, 'Cache size (tokens of the '
                                'whole conversation).')
_EXACT_TAIL = flags.DEFINE_integer('exact_tail', -1, 'Orthros: prompt tokens '
                                   'of each turn decoded exactly; -1 = as '
                                   'converted.')
_TEMPERATURE = flags.DEFINE_float('temperature', 0.0, '0 = greedy.')
_TOP_P = flags.DEFINE_float('top_p', None, 'Nucleus sampling.')
_SEED = flags.DEFINE_integer('seed', 0, 'Sampling seed.')


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f'unexpected arguments: {argv[1:]}')
  console.quiet_logging()
  from orthros_jax.chat import ChatSession  # pylint: disable=g-import-not-at-top
  from orthros_jax.chat import load_chat_model  # pylint: disable=g-import-not-at-top
  from orthros_jax.data import get_tokenizer  # pylint: disable=g-import-not-at-top
  if bool(_MODEL.value) == bool(_TEACHER.value):
    raise app.UsageError('give --model (an exported model) or --teacher '
                         '(with --adapter for Orthros)')
  if _MODEL.value:
    from orthros_jax.checkpoints.export import load_model  # pylint: disable=g-import-not-at-top
    config, params = load_model(_MODEL.value)
    if _EXACT_TAIL.value >= 0 and config.is_orthros:
      config = config.replace(attention={'exact_tail': _EXACT_TAIL.value})
    desc = f'{_MODEL.value}: {config.attention.kind} attention'
  else:
    if _ATTENTION.value == 'orthros' and not _ADAPTER.value:
      raise app.UsageError('--attention=orthros needs --adapter (an Orthros '
                           'adapter directory made by convert.py)')
    config, params, desc = load_chat_model(
        _TEACHER.value, _ADAPTER.value, _ATTENTION.value, _EXACT_TAIL.value)
  tokenizer = get_tokenizer(_TOKENIZER.value or _MODEL.value or _TEACHER.value)
  session = ChatSession(config, params, tokenizer, max_len=_MAX_LEN.value,
                        system=_SYSTEM.value,
                        temperature=_TEMPERATURE.value, top_p=_TOP_P.value,
                        seed=_SEED.value)
  print(f'[{desc}]', flush=True)
  turns = iter(_PROMPT.value) if _PROMPT.value else None
  while True:
    if turns is not None:
      text = next(turns, None)
      if text is not None:
        print(f'> {text}', flush=True)
    else:
      try:
        text = input('> ')
      except EOFError:
        text = None
    if not text:
      break
    reply = session.send(text, max_new_tokens=_MAX_NEW.value,
                         on_token=lambda s: print(s, end='', flush=True))
    print(f'\n[TTFT {reply.ttft_s:.2f} s for {reply.prompt_tokens} new '
          f'prompt tokens, {session.cached} in the cache, '
          f'{reply.decode_tokens_per_s:.1f} tokens/s, {len(reply.ids)} '
          f'tokens, stop: {reply.stopped}'
          f'{"; incl. XLA compilation" if reply.compiled else ""}]',
          flush=True)
  sys.stdout.flush()


if __name__ == '__main__':
  app.run(main)
