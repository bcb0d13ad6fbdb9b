"""The seed's environment variables: names, defaults, parsing, and what cannot apply on a CPU.

How each one changes what the engine does is tested where it acts: bucket
variables in test_gaudi_warmup_plan.py, QUEUE_THRESHOLD_MS in
test_gaudi_scheduler.py, the rest on a running engine in test_gaudi_env.py.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from switchyard_gaudi.settings import VARIABLES, GaudiSettings, SettingsError, inapplicable

SEED = Path(__file__).resolve().parents[3] / "shared" / "seeds"
SEED_TABLE = {
    # tgi-gaudi README's "Environment variables" and "Profiler" tables: name -> default
    "ENABLE_HPU_GRAPH": "True", "LIMIT_HPU_GRAPH": "False", "BATCH_BUCKET_SIZE": "8",
    "PREFILL_BATCH_BUCKET_SIZE": "4", "PAD_SEQUENCE_TO_MULTIPLE_OF": "128",
    "SKIP_TOKENIZER_IN_TGI": "False", "WARMUP_ENABLED": "True", "QUEUE_THRESHOLD_MS": "120",
    "USE_FLASH_ATTENTION": "False", "FLASH_ATTENTION_RECOMPUTE": "False",
    "PROF_WAITSTEP": "0", "PROF_WARMUPSTEP": "0", "PROF_STEP": "0",
    "PROF_PATH": "/tmp/hpu_profile", "PROF_RANKS": "0", "PROF_RECORD_SHAPES": "False",
    # set in the README's commands: off unless given
    "TEXT_GENERATION_SERVER_IGNORE_EOS_TOKEN": "False", "QUANT_CONFIG": "",
}


def test_every_seed_variable_is_read_with_the_seeds_default():
    names = {v.name for v in VARIABLES}
    defaults = GaudiSettings().as_env()
    for name, default in SEED_TABLE.items():
        assert name in names, f"{name} is not read"
        want = default.lower() if default in ("True", "False") else default
        assert defaults[name] == want, name


def test_the_table_above_is_the_seeds():
    """Where the seed README is beside the checkout, its tables are SEED_TABLE's first 16."""
    files = sorted(SEED.glob("000_*.txt"))
    if not files:
        pytest.skip("the seed README is not beside this checkout")
    rows = re.findall(r"^\|\s*([A-Z_]+)\s*\|\s*[^|]+?\s*\|\s*([^|]+?)\s*\|",
                      files[0].read_text(errors="replace"), re.MULTILINE)
    assert dict(rows) == dict(list(SEED_TABLE.items())[:16])


def test_every_variable_is_parsed_from_the_environment():
    env = {"ENABLE_HPU_GRAPH": "False", "LIMIT_HPU_GRAPH": "True", "BATCH_BUCKET_SIZE": "32",
           "PREFILL_BATCH_BUCKET_SIZE": "2", "PAD_SEQUENCE_TO_MULTIPLE_OF": "256",
           "SKIP_TOKENIZER_IN_TGI": "true", "WARMUP_ENABLED": "0", "QUEUE_THRESHOLD_MS": "250",
           "USE_FLASH_ATTENTION": "true", "FLASH_ATTENTION_RECOMPUTE": "yes",
           "TEXT_GENERATION_SERVER_IGNORE_EOS_TOKEN": "TRUE", "PROF_WAITSTEP": "1",
           "PROF_WARMUPSTEP": "2", "PROF_STEP": "3", "PROF_PATH": "/tmp/p", "PROF_RANKS": "0,1",
           "PROF_RECORD_SHAPES": "true", "BATCH_SIZE_EXPONENT_BASE": "2",
           "SEQ_LEN_EXPONENT_BASE": "3", "PT_HPU_LAZY_MODE": "0"}
    s = GaudiSettings.from_env(env)
    assert (s.enable_hpu_graph, s.limit_hpu_graph, s.batch_bucket_size,
            s.prefill_batch_bucket_size, s.pad_sequence_to_multiple_of) == (False, True, 32, 2, 256)
    assert (s.skip_tokenizer_in_tgi, s.warmup_enabled, s.queue_threshold_ms) == (True, False, 250)
    assert (s.use_flash_attention, s.flash_attention_recompute, s.ignore_eos_token) == \
        (True, True, True)
    assert (s.prof_waitstep, s.prof_warmupstep, s.prof_step, s.prof_path, s.prof_ranks,
            s.prof_record_shapes) == (1, 2, 3, "/tmp/p", (0, 1), True)
    assert (s.batch_size_exponent_base, s.seq_len_exponent_base, s.pt_hpu_lazy_mode) == \
        (2, 3, False)
    assert s.given == frozenset(env)
    assert GaudiSettings.from_env({}) == GaudiSettings()
    assert GaudiSettings.from_env({"BATCH_BUCKET_SIZE": " "}) == GaudiSettings()  # empty: unset


@pytest.mark.parametrize(("name", "value", "message"), [
    ("ENABLE_HPU_GRAPH", "maybe", "ENABLE_HPU_GRAPH='maybe' is not a flag"),
    ("BATCH_BUCKET_SIZE", "0", "BATCH_BUCKET_SIZE='0' must be at least 1"),
    ("PREFILL_BATCH_BUCKET_SIZE", "two", "is not an integer"),
    ("PAD_SEQUENCE_TO_MULTIPLE_OF", "-128", "must be at least 1"),
    ("QUEUE_THRESHOLD_MS", "-1", "must be at least 0"),
    ("PROF_STEP", "1.5", "is not an integer"),
    ("PROF_RANKS", "0,x", "not a comma-separated list of ranks"),
    ("BATCH_SIZE_EXPONENT_BASE", "1", "must be at least 2"),
    ("SEQ_LEN_EXPONENT_BASE", "1", "must be at least 2"),
    ("QUANT_CONFIG", "/nonexistent/maxabs_quant.json", "is not a file"),
])
def test_invalid_values_are_start_up_errors_naming_the_variable(name, value, message):
    with pytest.raises(SettingsError, match=re.escape(message)):
        GaudiSettings.from_env({name: value})


def test_what_cannot_apply_on_a_cpu_is_said_once_each():
    asked = GaudiSettings.from_env({"USE_FLASH_ATTENTION": "true",
                                    "FLASH_ATTENTION_RECOMPUTE": "true",
                                    "SKIP_TOKENIZER_IN_TGI": "true", "PT_HPU_LAZY_MODE": "1"})
    notes = inapplicable(asked, "cpu")
    assert [n.split("=")[0] for n in notes] == [
        "SKIP_TOKENIZER_IN_TGI", "USE_FLASH_ATTENTION", "FLASH_ATTENTION_RECOMPUTE",
        "PT_HPU_LAZY_MODE"]
    # On an HPU those are honoured, except tokenization, which is the gateway's.
    assert [n.split("=")[0] for n in inapplicable(asked, "hpu")] == ["SKIP_TOKENIZER_IN_TGI"]
    # Defaults ask for nothing the CPU cannot do.
    assert inapplicable(GaudiSettings(), "cpu") == []
