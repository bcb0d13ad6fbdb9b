"""best_of, watermark and fan-out in validation; OpenAI's n and logit_bias checks."""

from __future__ import annotations

import pytest

from switchyard.errors import ApiError
from switchyard.protocol.tgi import GenerateParameters
from switchyard.openai_mapping.plans import choice_count, logit_bias_pairs
from switchyard.settings import ServeSettings, TokenLimits
from switchyard.planning.plan import fan_out
from switchyard.planning.tgi import check_parameters, plan_tgi_prompt

LIMITS = TokenLimits(max_input_tokens=100, max_total_tokens=128)


def _message(params: GenerateParameters, settings: ServeSettings = ServeSettings()) -> str:
    with pytest.raises(ApiError) as err:
        check_parameters(params, settings)
    assert err.value.status == 422
    return err.value.message.removeprefix("Input validation error: ")


def test_best_of_rules_keep_tgi_messages():
    assert _message(GenerateParameters(best_of=2)) == "you must use sampling when `best_of` is > 1"
    assert _message(GenerateParameters(best_of=3, do_sample=True)) == (
        "`best_of` must be > 0 and <= 2. Given: 3")
    disabled = ServeSettings(max_best_of=1)
    assert _message(GenerateParameters(best_of=2, do_sample=True), disabled) == (
        "`best_of` != 1 is not allowed for this endpoint")
    assert _message(GenerateParameters(best_of=2, do_sample=True, seed=1)) == (
        "`seed` must not be set when `best_of` > 1")


def test_best_of_and_watermark_are_accepted():
    check_parameters(GenerateParameters(best_of=2, do_sample=True, watermark=True), ServeSettings())
    # TGI counts any warper given, even a neutral one, as asking for sampling.
    check_parameters(GenerateParameters(best_of=2, temperature=1.0), ServeSettings())
    plan = plan_tgi_prompt([1, 2], GenerateParameters(best_of=2, temperature=1.0, watermark=True,
                                                 decoder_input_details=True), LIMITS, ())
    assert plan.sampling.do_sample and plan.sampling.watermark
    assert plan.prompt_logprobs and plan.details


def test_fan_out_seeds_and_prompt_logprobs():
    plan = plan_tgi_prompt([1, 2], GenerateParameters(do_sample=True, seed=2**64 - 1,
                                                 decoder_input_details=True), LIMITS, ())
    plans = fan_out(plan, 3)
    assert plans[0] is plan
    assert [p.sampling.seed for p in plans] == [2**64 - 1, 0, 1]
    assert [p.prompt_logprobs for p in plans] == [True, False, False]
    greedy = plan_tgi_prompt([1], GenerateParameters(max_new_tokens=1), LIMITS, ())
    assert {p.sampling.seed for p in fan_out(greedy, 2)} == {None}


def test_choice_count():
    assert choice_count(None) == 1 and choice_count(128) == 128
    for bad in (0, -1, 129):
        with pytest.raises(ApiError) as err:
            choice_count(bad)
        assert err.value.param == "n" and err.value.status == 400  # OpenAI's status


def test_logit_bias_pairs():
    assert logit_bias_pairs(None, 10) == ()
    assert logit_bias_pairs({"9": 100, "0": -100.0, "3": 0.5}, 10) == (
        (0, -100.0), (3, 0.5), (9, 100.0))
    for bad in ({"10": 1}, {"-1": 1}, {"x": 1}, {"1.5": 1}, {"1": 100.5}, {"1": -101},
                {str(i): 1 for i in range(301)}):
        with pytest.raises(ApiError) as err:
            logit_bias_pairs(bad, 1000 if len(bad) > 1 else 10)
        assert err.value.param == "logit_bias" and err.value.status == 400
