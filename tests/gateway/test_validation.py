"""TGI's validation rules, order and messages, without a server."""

from __future__ import annotations

import pytest

from switchyard.errors import ApiError
from switchyard.protocol.tgi import GenerateParameters
from switchyard.settings import (
    ServeSettings,
    TokenLimits,
    resolve_num_shard,
    resolve_token_limits,
)
from switchyard.planning.tgi import check_inputs, check_parameters, plan_tgi_prompt

SETTINGS = ServeSettings()
LIMITS = TokenLimits(max_input_tokens=100, max_total_tokens=128)


def _msg(params: GenerateParameters) -> str:
    with pytest.raises(ApiError) as err:
        check_parameters(params, SETTINGS)
    assert err.value.status == 422 and err.value.error_type == "validation"
    return err.value.message.removeprefix("Input validation error: ")


@pytest.mark.parametrize(("params", "message"), [
    (GenerateParameters(best_of=2), "you must use sampling when `best_of` is > 1"),
    (GenerateParameters(temperature=0.0), "`temperature` must be strictly positive"),
    (GenerateParameters(repetition_penalty=0.0), "`repetition_penalty` must be strictly positive"),
    (GenerateParameters(frequency_penalty=3.0), "`frequency_penalty` must be >= -2.0 and <= 2.0"),
    (GenerateParameters(top_p=1.0), "`top_p` must be > 0.0 and < 1.0"),
    (GenerateParameters(typical_p=0.0), "`typical_p` must be > 0.0 and < 1.0"),
    (GenerateParameters(top_k=0), "`top_k` must be strictly positive"),
    (GenerateParameters(max_new_tokens=0), "`max_new_tokens` must be strictly positive"),
    (GenerateParameters(stop=["a"] * 5), "`stop` supports up to 4 stop sequences. Given: 5"),
    (GenerateParameters(top_n_tokens=6), "`top_n_tokens` must be >= 0 and <= 5. Given: 6"),
])
def test_messages(params, message):
    assert _msg(params) == message


def test_order_temperature_before_top_p():
    assert "temperature" in _msg(GenerateParameters(temperature=-1.0, top_p=2.0))


def test_inputs_and_truncate():
    with pytest.raises(ApiError, match="`inputs` cannot be empty"):
        check_inputs("", GenerateParameters(), LIMITS)
    with pytest.raises(ApiError, match="`truncate` must be strictly positive and less than 100"):
        check_inputs("x", GenerateParameters(truncate=101), LIMITS)


def test_token_limits_messages():
    with pytest.raises(ApiError) as err:
        plan_tgi_prompt(list(range(50)), GenerateParameters(max_new_tokens=100), LIMITS, ())
    assert err.value.message.endswith(
        "`inputs` tokens + `max_new_tokens` must be <= 128. Given: 50 `inputs` tokens and 100 "
        "`max_new_tokens`")
    with pytest.raises(ApiError, match="`inputs` must have less than 100 tokens. Given: 110"):
        plan_tgi_prompt(list(range(110)), GenerateParameters(max_new_tokens=1), LIMITS, ())


def test_truncate_keeps_last_tokens_and_default_budget():
    plan = plan_tgi_prompt(list(range(50)), GenerateParameters(truncate=10), LIMITS, (7,))
    assert plan.prompt_ids == tuple(range(40, 50))
    assert plan.stopping.max_new_tokens == 128 - 10
    assert plan.stopping.eos_token_ids == (7,)


def test_sampling_switches_on_with_warpers_and_seed_is_reported():
    greedy = plan_tgi_prompt([1], GenerateParameters(max_new_tokens=1), LIMITS, ())
    assert not greedy.sampling.do_sample and greedy.sampling.seed is None
    warped = plan_tgi_prompt([1], GenerateParameters(max_new_tokens=1, top_k=5), LIMITS, ())
    assert warped.sampling.do_sample and warped.sampling.seed is not None


def test_resolve_token_limits():
    assert resolve_token_limits(ServeSettings(), 2048) == TokenLimits(
        max_input_tokens=2047, max_total_tokens=2048, source="the model's context, at most 4096")
    with pytest.raises(ValueError):
        resolve_token_limits(ServeSettings(max_input_tokens=10, max_total_tokens=10), 2048)
    with pytest.raises(ValueError, match="exceeds the model's max_position_embeddings"):
        resolve_token_limits(ServeSettings(max_total_tokens=4096), 2048)
    # A config without a position limit (Bloom's ALiBi): the default bounds it, nothing else.
    assert resolve_token_limits(ServeSettings(), 0) == TokenLimits(
        max_input_tokens=4095, max_total_tokens=4096, source="the model's context, at most 4096")
    assert resolve_token_limits(ServeSettings(max_total_tokens=9000), 0).max_total_tokens == 9000


def test_the_engines_length_is_the_default_and_the_flags_win():
    """ModelInfo.max_total_tokens (what the engine serves) is the default; flags override it
    and stay bounded by the model's context."""
    limits = resolve_token_limits(ServeSettings(), 8192, 8192, "the model's context")
    assert limits == TokenLimits(max_input_tokens=8191, max_total_tokens=8192,
                                 source="the model's context")
    assert resolve_token_limits(ServeSettings(), 8192, 5000).max_total_tokens == 5000
    assert resolve_token_limits(ServeSettings(max_total_tokens=2048), 8192, 8192) == TokenLimits(
        max_input_tokens=2047, max_total_tokens=2048, source="--max-total-tokens")
    assert resolve_token_limits(ServeSettings(), 8192, 0).max_total_tokens == 4096
    with pytest.raises(ValueError, match="max_position_embeddings"):
        resolve_token_limits(ServeSettings(max_total_tokens=9000), 8192, 8192)


@pytest.mark.parametrize(("sharded", "num_shard", "ranks"), [
    (None, None, 1), (False, None, 1), (None, 4, 4), (True, 2, 2), (True, None, 0)])
def test_resolve_num_shard_follows_tgi(sharded, num_shard, ranks):
    # TGI's launcher: --num-shard implies sharding; --sharded true alone means every device.
    assert resolve_num_shard(ServeSettings(sharded=sharded, num_shard=num_shard)) == ranks


@pytest.mark.parametrize(("sharded", "num_shard"), [(False, 2), (True, 1)])
def test_resolve_num_shard_refuses_contradictions(sharded, num_shard):
    with pytest.raises(ValueError, match="--sharded"):
        resolve_num_shard(ServeSettings(sharded=sharded, num_shard=num_shard))
