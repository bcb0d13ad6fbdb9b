"""LangChain's OpenAI chat model against the session server: structured output and tools.

`with_structured_output` (OpenAI's `json_schema` response format, strict) and
`bind_tools` with a forced tool are what agent frameworks send; the model is
random, so every object that validates does so because the grammar held it.
"""

from __future__ import annotations

import pytest
from pydantic import BaseModel, Field

langchain_openai = pytest.importorskip("langchain_openai")


class Forecast(BaseModel):
    """What the weather will be."""

    city: str = Field(max_length=8)
    days: int = Field(ge=1, le=7)


@pytest.fixture(scope="module")
def chat(server):
    return langchain_openai.ChatOpenAI(base_url=f"{server.url}/v1", api_key="-", model="tgi",
                                       max_tokens=80, temperature=0, timeout=120)


def test_with_structured_output_returns_a_valid_object(chat):
    answer = chat.with_structured_output(Forecast).invoke("Weather in Rome for three days?")
    assert isinstance(answer, Forecast)
    assert 1 <= answer.days <= 7 and len(answer.city) <= 8


def test_bind_tools_with_a_forced_tool_returns_a_valid_call(chat):
    bound = chat.bind_tools([Forecast], tool_choice="Forecast")
    message = bound.invoke("Weather in Rome for three days?")
    (call,) = message.tool_calls
    assert call["name"] == "Forecast" and call["id"].startswith("call_")
    Forecast.model_validate(call["args"])
