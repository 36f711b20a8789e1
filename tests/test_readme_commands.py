"""Every train.py / convert.py / eval.py command README.md (and the TPU
quickstart, docs/tpu_quickstart.md) shows parses as
written: its config file loads with all its --config.x.y=... overrides the
way the entry point's absl flags do (ml_collections.config_flags: a key
that does not exist or a value of the wrong type is an error), its other
flags are defined by the script (and the required ones are given), and the
resulting config passes the cheap checks the entry point runs before any
work. Nothing is trained. `make ...` commands are the Makefile's (their
targets must exist there).

Commands come from the ```bash blocks (backslash-continued lines joined,
comments dropped, nested quoted commands such as `gcloud ... --command="cd
... && python train.py ..."` opened) and from inline `train.py --config...`
spans; inline spans and commands with `...` are fragments, so only their
config is checked.
"""

import os
import re
import shlex

import pytest
from absl import flags
from ml_collections import config_flags

pytestmark = pytest.mark.filterwarnings(
    'ignore:the load_module:DeprecationWarning')  # ml_collections' loader

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = os.path.join(REPO, 'README.md')
DOCS = ('README.md', 'docs/tpu_quickstart.md')
SCRIPTS = ('train.py', 'convert.py', 'eval.py')
OPERATORS = {'&&', '||', ';', '|', '&'}


def _words(text: str) -> list[str]:
  """shlex words of one shell line; a word with spaces (a quoted command)
  is opened into its own words."""
  out = []
  for word in shlex.split(text, comments=True):
    if re.search(r'\s', word):
      head, sep, rest = word.partition('=')
      if sep and head.startswith('-') and not re.search(r'\s', head):
        word = rest  # --command="cd x && python train.py ..."
      out += _words(word)
    else:
      out.append(word)
  return out


def _bash_lines(doc: str = 'README.md'):
  """(line number, logical line) for every line of `doc`'s bash blocks."""
  with open(os.path.join(REPO, doc)) as f:
    lines = f.read().split('\n')
  out, in_block, current, start = [], False, '', 0
  for i, line in enumerate(lines, 1):
    if line.startswith('```'):
      in_block = line.strip() == '```bash'
      continue
    if not in_block:
      continue
    if not current:
      start = i
    if line.endswith('\\'):
      current += line[:-1] + ' '
      continue
    out.append((start, current + line))
    current = ''
  return out


def _commands():
  """(id, script, args, complete) for each entry-point command."""
  found = []
  for doc in DOCS:
    for lineno, line in _bash_lines(doc):
      words = _words(line)
      for i, word in enumerate(words):
        if os.path.basename(word) in SCRIPTS:
          args = []
          for arg in words[i + 1:]:
            if arg in OPERATORS:
              break
            args.append(arg)
          found.append((f'{doc}:{lineno}', os.path.basename(word), args,
                        '...' not in args))
  with open(README) as f:
    for lineno, line in enumerate(f, 1):
      for span in re.findall(r'`([^`]*)`', line):
        words = span.split()
        if words and words[0] in ('python', '.venv/bin/python'):
          words = words[1:]
        if words and words[0] in SCRIPTS and len(words) > 1:
          found.append((f'README.md:{lineno} (inline)', words[0], words[1:],
                        False))
  return found


def _make_commands():
  out = []
  for doc in DOCS:
    for lineno, line in _bash_lines(doc):
      words = _words(line)
      if words and words[0] == 'make':
        out.append((f'{doc}:{lineno}', [w for w in words[1:] if '=' not in w]))
  return out


COMMANDS = _commands()


def _flag_name(arg: str) -> str:
  return arg[2:].split('=', 1)[0]


def load_config(args: list[str]):
  """The ConfigDict the entry point's --config flag yields for `args`
  (config_flags: unknown keys and ill-typed values raise)."""
  argv = ['prog'] + [a for a in args if _flag_name(a) == 'config'
                     or _flag_name(a).startswith('config.')]
  values = flags.FlagValues()
  holder = config_flags.DEFINE_config_file(
      'config', None, 'Config file.', flag_values=values, lock_config=True,
      sys_argv=argv)
  values(argv)
  return holder.value


def _script_flags(script: str) -> tuple[set[str], set[str]]:
  """(defined flag names, required flag names) of an entry point."""
  with open(os.path.join(REPO, script)) as f:
    source = f.read()
  defined = set(re.findall(r"DEFINE_\w+\(\s*'(\w+)'", source))
  required = set()
  for group in re.findall(r'mark_flags?_as_required\(\s*\[?([^\])]*)',
                          source):
    required |= set(re.findall(r"'(\w+)'", group))
  return defined, required


def _entry_checks(script: str, config) -> None:
  """What the entry point checks before loading a model or data."""
  if script == 'train.py':
    from orthros_jax.training import loop
    from orthros_jax.config import model_config_from
    model_config_from(config.model)
    loop.TrainConfig.from_mapping(config.train.to_dict())
  elif script == 'convert.py':
    from orthros_jax.conversion import plan
    plan.check_config(config)


def test_readme_commands_are_found():
  # The parser sees the README's commands, including the At scale
  # conversion on local text.
  scripts = [c[1] for c in COMMANDS]
  assert scripts.count('train.py') >= 5, COMMANDS
  assert scripts.count('convert.py') >= 4, COMMANDS
  assert scripts.count('eval.py') >= 3, COMMANDS
  assert any(s == 'convert.py' and '--config.data.paths=/data/corpus' in a
             for _, s, a, _ in COMMANDS)
  # The TPU quickstart's conversion and evaluation.
  assert any(w.startswith('docs/tpu_quickstart.md') and s == 'convert.py'
             for w, s, _, _ in COMMANDS)
  # The nested command of the TPU example is opened.
  assert any(s == 'train.py' and '--config.mesh.shape.fsdp=-1' in a and
             '--config.data.paths=/data/corpus' in a for _, s, a, _ in COMMANDS)


@pytest.mark.parametrize('where, script, args, complete', COMMANDS,
                         ids=[c[0] for c in COMMANDS])
def test_readme_command_parses(where, script, args, complete, monkeypatch):
  monkeypatch.chdir(REPO)  # config paths are relative to the repo root
  args = [a for a in args if a != '...']
  assert os.path.isfile(os.path.join(REPO, script)), where
  defined, required = _script_flags(script)
  given = set()
  for arg in args:
    assert arg.startswith('--') and '=' in arg, (
        f'{where}: {arg!r} is not a --flag=value argument')
    name = _flag_name(arg)
    given.add(name.split('.', 1)[0])
    assert name.split('.', 1)[0] in defined, (
        f'{where}: {script} defines no flag --{name}')
  if complete:
    assert required <= given, f'{where}: missing {sorted(required - given)}'
  config = load_config(args)
  _entry_checks(script, config)


def test_load_config_rejects_a_missing_key(monkeypatch):
  monkeypatch.chdir(REPO)
  with pytest.raises(AttributeError, match='no_such_key'):
    load_config(['--config=configs/convert_tiny.py',
                 '--config.data.no_such_key=1'])
  with pytest.raises(flags.IllegalFlagValueError):
    load_config(['--config=configs/tiny.py', '--config.train.num_steps=x'])
  config = load_config(['--config=configs/convert_tiny.py',
                        '--config.data.source=text',
                        '--config.data.paths=/data/corpus'])
  assert config.data.paths == '/data/corpus'


def test_make_targets_exist():
  with open(os.path.join(REPO, 'Makefile')) as f:
    targets = set(re.findall(r'^([\w.-]+):', f.read(), re.M))
  commands = _make_commands()
  assert commands
  for lineno, words in commands:
    for target in words:
      assert target in targets, f'{lineno}: no make target {target}'
