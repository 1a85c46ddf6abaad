"""--data text:PATH: the harness trains on byte-level tokens of real text (the Python standard
library's own sources here: real, varied, and present wherever Python is)."""

import os

import pytest
import torch

from conftest import assert_trained, run_tiny
from megatron_patches.testing.data import TextCorpus
from megatron_patches.errors import UserError

pytestmark = pytest.mark.one_line  # the same on every megatron-core line (conftest)

STDLIB = os.path.dirname(os.__file__)


def test_text_corpus_is_deterministic_and_sample_indices_are_stable():
    a = TextCorpus(STDLIB, seq_length=32, seed=7, max_bytes=2**20)
    b = TextCorpus(STDLIB, seq_length=32, seed=7, max_bytes=2**20)
    assert a.size == b.size == 2**20 and a.truncated and a.files == b.files
    for index in (0, 1, 12345, a.windows + 3):
        assert torch.equal(a.sample(index), b.sample(index))
        assert a.sample(index).shape == (33,) and int(a.sample(index).max()) < 256
    # An index past the end names the same tokens again (the sampler never runs out).
    assert torch.equal(a.sample(5), a.sample(5 + a.windows))
    # The tokens are the file's bytes: a single file's windows cover its text.
    one = TextCorpus(os.__file__, seq_length=32, seed=0)
    text = open(os.__file__, "rb").read()
    assert not one.truncated and one.files == 1 and one.size == len(text)
    start = int(one.order[0]) * 33
    assert bytes(one.sample(0).tolist()) == text[start:start + 33]
    assert "cut at the --data-max-mib bound (1 MiB)" in a.describe() and "cut" not in one.describe()


def test_text_corpus_errors_name_the_path_and_the_fix(tmp_path):
    with pytest.raises(UserError, match="no such file or directory"):
        TextCorpus(str(tmp_path / "missing"), seq_length=32)
    (tmp_path / "bin").write_bytes(b"\x00\xff\xfe" * 100)
    with pytest.raises(UserError, match="no UTF-8 text files there"):
        TextCorpus(str(tmp_path), seq_length=32)
    (tmp_path / "short.txt").write_text("hello")
    with pytest.raises(UserError, match=r"5 bytes of text, fewer than one sample needs \(--seq 32 \+ 1 = 33\)"):
        TextCorpus(str(tmp_path), seq_length=32)


@pytest.mark.parametrize(
    "args, message",
    [
        (["--data", "text:/no/such/dir"], "--data text:/no/such/dir: no such file or directory"),
        (["--data", "words"], "--data must be synthetic or text:PATH, got 'words'"),
        (["--data", f"text:{STDLIB}", "--vocab", "128"], "--vocab must be >= 256 with --data text:"),
        (["--data-max-mib", "0"], "--data-max-mib must be > 0"),
    ],
)
def test_bad_data_arguments_are_one_clear_line(tmp_path, args, message):
    run = run_tiny(tmp_path, *args)
    assert run.returncode == 2, run.output[-2000:]
    errors = [line for line in run.output.splitlines() if line.startswith("tiny_gpt: error:")]
    assert len(errors) == 1 and message in errors[0], run.output[-2000:]
    assert "Traceback" not in run.output


def test_trains_on_text_with_a_byte_vocabulary(tmp_path):
    run = run_tiny(tmp_path, "--data", f"text:{STDLIB}", "--data-max-mib", "2", "--steps", "40")
    result = assert_trained(run, min_drop=1.0)  # from ln(256) = 5.5 towards real structure
    assert result["initial_loss"] > 5.0 and result["incidents"] == 0
    assert "data: 2.0 MiB of text from" in run.output and "cut at the --data-max-mib bound (2 MiB)" in run.output
