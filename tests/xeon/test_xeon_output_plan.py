"""Which logits a step keeps: the last position per sequence, whole prompts only when asked."""

from __future__ import annotations

from switchyard_engine.sampling import RowSampler
from switchyard_spec import EngineRequest, SamplingParams, StoppingParams
from switchyard_xeon.runner import plan_outputs
from switchyard_xeon.sequence import Sequence


def _seq(prompt: list[int], prompt_logprobs: bool, cached: int = 0) -> Sequence:
    request = EngineRequest(request_id=str(id(prompt)), prompt_token_ids=tuple(prompt),
                            sampling=SamplingParams(), prompt_logprobs=prompt_logprobs,
                            stopping=StoppingParams(max_new_tokens=4))
    seq = Sequence(request, lambda e: None, RowSampler(request.sampling, prompt, 100),
                   max_length=len(prompt) + 4, ignore_eos=False)
    seq.num_cached = cached
    seq.num_scheduled = len(prompt) - cached  # the rest of the prompt in one go
    return seq


def test_plain_steps_keep_one_row_per_sequence():
    seqs = [_seq([1, 2, 3], False), _seq([4, 5], False, cached=2)]
    seqs[1].tokens.append(9)  # decoding: one new token
    seqs[1].num_scheduled = 1
    plan = plan_outputs(seqs, [0, 3])
    assert plan.keep == [2, 3] and plan.sample_rows == [0, 1] and plan.only_last


def test_asking_prefill_keeps_its_prompt_positions():
    seqs = [_seq([1, 2], False), _seq([10, 11, 12, 13], True), _seq([7], True)]
    plan = plan_outputs(seqs, [0, 2, 6])
    assert plan.keep == [1, 2, 3, 4, 5, 6]
    assert plan.sample_rows == [0, 4, 5]
    assert plan.prompt_rows == [1, 2, 3] and plan.prompt_targets == [11, 12, 13]
    assert plan.prompt_counts == [0, 3, 0]  # a one-token prompt has nothing to score


def test_a_chunk_short_of_the_prompt_end_scores_but_does_not_sample():
    plain = _seq([1, 2, 3, 4, 5, 6], False)
    plain.num_scheduled = 4
    asking = _seq([10, 11, 12, 13, 14, 15], True)
    asking.num_scheduled = 3
    decoding = _seq([7, 8], False, cached=2)
    decoding.tokens.append(9)
    decoding.num_scheduled = 1
    plan = plan_outputs([plain, asking, decoding], [0, 4, 7])
    assert plan.keep == [4, 5, 6, 7]  # nothing for the plain chunk; all of the asking one
    assert plan.sample_rows == [3]  # only the decoding sequence samples
    assert plan.prompt_rows == [0, 1, 2] and plan.prompt_targets == [11, 12, 13]
    assert plan.prompt_counts == [0, 3, 0]


def test_a_later_chunk_scores_the_rest_of_the_prompt():
    """With the prompt fed in two chunks, the second scores the tokens after the first."""
    seq = _seq([10, 11, 12, 13, 14], True, cached=2)
    plan = plan_outputs([seq], [0])
    assert plan.keep == [0, 1, 2] and plan.prompt_targets == [13, 14]
    seq.num_cached, seq.num_scheduled = 5, 1
    seq.tokens.append(99)
    assert plan_outputs([seq], [0]).only_last  # decoding: the prompt is done
