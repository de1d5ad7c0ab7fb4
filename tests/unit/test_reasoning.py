"""Reasoning apart from the answer (serve/openai/reasoning.py, openai/text.py's ChoiceText), on recorded
completions of each convention, tokenized by a tokenizer whose markers are single tokens as in
the published vocabularies (Qwen3 / DeepSeek-R1 think tags, gpt-oss harmony)."""

from __future__ import annotations

import pytest
from tokenizers import AddedToken, Tokenizer

from moe_workers.model.tokenizer import write_byte_tokenizer
from moe_workers.serve.openai.reasoning import HARMONY, THINK_CLOSE, THINK_OPEN, Splitter, reasoning_format, split
from moe_workers.serve.openai.text import ChoiceText


def _tokenizer(tmp_path, markers):
    tok = Tokenizer.from_file(str(write_byte_tokenizer(tmp_path)))
    tok.add_special_tokens([AddedToken(m, special=True) for m in markers])
    return tok


def _stream(tok, fmt, prompt_text, completion_text, stops=()):
    prompt = tok.encode(prompt_text, add_special_tokens=False).ids
    ids = tok.encode(completion_text, add_special_tokens=False).ids
    whole = split(fmt, prompt, ids, tok.decode)
    choice = ChoiceText(tok.decode, list(stops), Splitter(fmt, prompt, tok.decode))
    answer, thinking = "", ""
    for t in ids:
        a, r = choice.push(t)
        answer, thinking = answer + a, thinking + r
        if choice.stopped:
            break
    a, r = choice.finish()
    return tok.decode(whole[0]), tok.decode(whole[1]), thinking + r, answer + a


@pytest.mark.parametrize("prompt,completion,thinking,answer", [
    ("<|user|>Hi", "<think>\nThe user greets. Keep it short.\n</think>\n\nHello!", "\nThe user greets. Keep it "
     "short.\n", "\n\nHello!"),
    ("<|user|>Hi<think>\n", "They greet me.\n</think>Hello!", "They greet me.\n", "Hello!"),  # R1: opened by the prompt
    ("<|user|>Hi<think>x</think>ok<|user|>again", "Just text, no thinking.", "", "Just text, no thinking."),
    ("<|user|>Hi", "plain <think-ish> text", "", "plain <think-ish> text"),  # only the marker token counts
])
def test_think_tags_split_whole_and_streamed_alike(tmp_path, prompt, completion, thinking, answer):
    tok = _tokenizer(tmp_path, [THINK_OPEN, THINK_CLOSE])
    fmt = reasoning_format(tok.get_vocab(with_added_tokens=True), "qwen3_moe")
    assert fmt.kind == "think"
    whole_thinking, whole_answer, streamed_thinking, streamed_answer = _stream(tok, fmt, prompt, completion)
    assert (whole_thinking, whole_answer) == (thinking, answer)
    assert (streamed_thinking, streamed_answer) == (thinking, answer)


def test_harmony_channels_split_analysis_from_final(tmp_path):
    tok = _tokenizer(tmp_path, list(HARMONY) + ["<|constrain|>"])
    fmt = reasoning_format(tok.get_vocab(with_added_tokens=True), "gpt_oss")
    assert fmt.kind == "harmony"
    assert reasoning_format(tok.get_vocab(with_added_tokens=True), "mixtral") is None  # harmony is gpt-oss'
    prompt = "<|start|>user<|message|>What is 2+2?<|end|><|start|>assistant"
    completion = ("<|channel|>analysis<|message|>Simple sum: 4.<|end|><|start|>assistant<|channel|>final"
                  "<|message|>2 + 2 = 4.<|return|>")
    assert _stream(tok, fmt, prompt, completion) == ("Simple sum: 4.", "2 + 2 = 4.", "Simple sum: 4.", "2 + 2 = 4.")
    # a preamble on commentary is answer; a message to a function (in the channel or the role
    # header) is a tool call, neither side (serve/openai/tools.py reads it); headers never show
    tool = ("<|channel|>analysis<|message|>Need weather.<|end|><|start|>assistant<|channel|>commentary"
            "<|message|>Checking.<|end|><|start|>assistant<|channel|>commentary to=functions.get_weather "
            "<|constrain|>json<|message|>{\"city\":\"Paris\"}<|call|>")
    assert _stream(tok, fmt, prompt, tool) == ("Need weather.", "Checking.", "Need weather.", "Checking.")
    header = "<|channel|>analysis<|message|>ok<|end|><|start|>assistant to=functions.f<|channel|>commentary json" \
             "<|message|>{}<|call|>"
    assert _stream(tok, fmt, prompt, header) == ("ok", "", "ok", "")


def test_stop_sequences_apply_to_the_answer_only(tmp_path):
    tok = _tokenizer(tmp_path, [THINK_OPEN, THINK_CLOSE])
    fmt = reasoning_format(tok.get_vocab(with_added_tokens=True), "qwen3_moe")
    got = _stream(tok, fmt, "Q", "<think>STOP is a word here</think>Answer STOP tail", stops=["STOP"])
    assert got[2:] == ("STOP is a word here", "Answer ")


def test_a_vocabulary_without_markers_has_no_reasoning(tmp_path):
    tok = _tokenizer(tmp_path, [])
    assert reasoning_format(tok.get_vocab(with_added_tokens=True), "qwen3_moe") is None
    choice = ChoiceText(tok.decode, [], None)
    ids = tok.encode("<think>hi</think>", add_special_tokens=False).ids
    assert "".join(choice.push(t)[0] for t in ids) + choice.finish()[0] == "<think>hi</think>"
