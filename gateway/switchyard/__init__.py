"""Switchyard: an LLM serving gateway speaking the OpenAI and TGI APIs over hardware plugins."""

__version__ = "0.1.0"
