"""The harmony format (gpt-oss's chat format), as far as the engine reads it: its tokens.

A harmony output is a run of messages, each a header, `<|message|>`, a body and its end:

    <|channel|>analysis<|message|>thinking...<|end|><|start|>assistant<|channel|>final<|message|>answer<|return|>
    ^ the template's generation prompt ends `<|start|>assistant`, so the first header starts at its channel

A header names the message's channel (`analysis`: reasoning; `final`: the answer; `commentary`: tool
calls, `to=functions.NAME`, and preambles) and may name a recipient and a content type
(`<|constrain|>json`). `<|return|>` ends the answer and `<|call|>` a tool call: both are the model's
end-of-sequence tokens. The header tokens are special tokens, which a plain decoding drops; the engine
shows them (engine/detokenizer.py) so that what reads the text (app/serving/harmony.py) sees the
structure, and splits the analysis off as reasoning (engine/reasoning.py's ChannelSplit).
"""

from __future__ import annotations

from transformers import PreTrainedTokenizerBase

START, END, MESSAGE, CHANNEL, CONSTRAIN = "<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>"
RETURN, CALL = "<|return|>", "<|call|>"
# The tokens that structure the text between messages and within a header: shown in the output's text.
SYNTAX = (START, END, MESSAGE, CHANNEL, CONSTRAIN)


def syntax_token_ids(tokenizer: PreTrainedTokenizerBase) -> dict[str, int] | None:
    """The harmony syntax tokens' ids by text where the vocabulary has each as a token of its own (a
    harmony model's), else None."""
    vocab = tokenizer.get_vocab()
    ids = {text: vocab.get(text) for text in SYNTAX}
    return None if None in ids.values() else ids
