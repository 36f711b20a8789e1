"""A tiny teacher and its conversion, shared by the tests of the pipeline
(tests/test_convert.py) and of its adapter (tests/test_adapter.py): session
fixtures registered in tests/conftest.py, so each runs once per worker."""

import pytest

from configs import convert_tiny
from configs import tiny
from orthros_jax.config import model_config_from
from orthros_jax.conversion import pipeline
from orthros_jax.training import checkpoint as ckpt_lib
from orthros_jax.training.train_lm import train_and_evaluate


def convert_config(teacher_dir):
  """configs/convert_tiny.py:smoke on the teacher in `teacher_dir`."""
  c = convert_tiny.get_config('smoke')
  c.teacher.checkpoint = str(teacher_dir)
  c.eval.num_examples = 4
  return c


def load_teacher(teacher_dir):
  """(ModelConfig, params) of the teacher checkpoint in `teacher_dir`."""
  params, config, _ = ckpt_lib.load_params(teacher_dir)
  return model_config_from(config), params


@pytest.fixture(scope='session')
def teacher_dir(tmp_path_factory):
  workdir = tmp_path_factory.mktemp('teacher')
  train_and_evaluate(tiny.get_config('smoke'), workdir)
  return workdir


@pytest.fixture(scope='session')
def converted(teacher_dir, tmp_path_factory):  # pylint: disable=redefined-outer-name
  workdir = tmp_path_factory.mktemp('converted')
  report = pipeline.convert(convert_config(teacher_dir), workdir)
  return workdir, report
