"""Chat templates (sandboxed, as transformers renders them) and stop sequences over a token
stream: pure, no server."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from moe_workers.serve.openai.chat import ChatTemplate, TemplateError, write_tokenizer_config
from moe_workers.serve.openai.protocol import ChatMessage, RequestError
from moe_workers.serve.openai.text import TextStream


def _msgs(*pairs):
    return [ChatMessage(role=r, content=c) for r, c in pairs]


def test_the_checkpoint_template_renders_like_transformers(tmp_path):
    import transformers
    from tokenizers import Tokenizer
    from moe_workers.model.tokenizer import write_byte_tokenizer

    write_byte_tokenizer(tmp_path)
    write_tokenizer_config(tmp_path)
    hf = transformers.PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_file(str(tmp_path / "tokenizer.json")),
                                              bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    hf.chat_template = json.loads((tmp_path / "tokenizer_config.json").read_text())["chat_template"]
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"},
                {"role": "assistant", "content": "hello"}, {"role": "user", "content": "again"}]
    ours = ChatTemplate.from_checkpoint(tmp_path).render([ChatMessage(**m) for m in messages])
    assert ours == hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def test_template_sources_and_their_absence(tmp_path):
    assert ChatTemplate.from_checkpoint(tmp_path) is None  # no tokenizer_config.json: no chat
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": {"content": "</s>"}, "chat_template": [
        {"name": "tool_use", "template": "T"}, {"name": "default", "template": "{{ messages[0]['content'] }}{{ eos_token }}"}]}))
    assert ChatTemplate.from_checkpoint(tmp_path).render(_msgs(("user", "x"))) == "x</s>"
    (tmp_path / "chat_template.jinja").write_text("J{{ messages | length }}")  # the file wins
    assert ChatTemplate.from_checkpoint(tmp_path).render(_msgs(("user", "x"), ("user", "y"))) == "J2"
    with pytest.raises(TemplateError, match="does not parse"):
        ChatTemplate("{% for %}", {})


@pytest.mark.parametrize("source,needle", [
    ("{% if messages[0]['role'] != 'user' %}{{ raise_exception('must start with user') }}{% endif %}",
     "refuses this conversation: must start with user"),
    ("{{ ''.__class__.__mro__ }}", "unsafe"),  # the sandbox
    ("{{ messages[0]['content'] / 2 }}", "cannot render"),
    ("{% for i in range(10**6) %}{{ 'x' * 100 }}{% endfor %}", "Range too big"),
])
def test_a_template_that_fails_is_a_400_naming_messages(source, needle):
    with pytest.raises(RequestError) as err:
        ChatTemplate(source, {}).render(_msgs(("system", "x")))
    assert err.value.status == 400 and err.value.param == "messages" and needle in err.value.message


def test_content_parts_are_joined():
    msg = ChatMessage.model_validate({"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]})
    assert ChatTemplate("{{ messages[0]['content'] }}", {}).render([msg]) == "ab"


def _chars(tokens):
    return "".join(chr(t) for t in tokens)


def test_stop_is_cut_and_never_sent_in_pieces():
    ts = TextStream(_chars, ["END", "\n\n"])
    sent = "".join(ts.push(ord(c)) for c in "hello EN world E\nEND more")
    assert sent == "hello EN world E\n" == ts.text and ts.stopped and ts.finish() == ""


def test_incomplete_characters_wait_for_their_bytes():
    data = "héllo".encode()

    def decode(tokens):
        return bytes(tokens).decode("utf-8", errors="replace")
    ts = TextStream(decode, [])
    out = [ts.push(b) for b in data]
    assert out == ["h", "", "é", "l", "l", "o"] and ts.finish() == ""


@settings(max_examples=300, deadline=None)
@given(text=st.text(alphabet="abc\n", max_size=40), stops=st.lists(st.text(alphabet="abc\n", min_size=1, max_size=4),
                                                                    max_size=4))
def test_streamed_pieces_equal_the_text_cut_at_the_first_stop_to_complete(text, stops):
    """As vLLM does: after each token, the first stop sequence found in the text so far ends it."""
    ts = TextStream(_chars, stops)
    sent = "".join(ts.push(ord(c)) for c in text) + ts.finish()
    want, stopped = text, False
    for k in range(1, len(text) + 1):
        cuts = [i for s in stops if (i := text[:k].find(s)) >= 0]
        if cuts:
            want, stopped = text[:min(cuts)], True
            break
    assert sent == want and ts.text == want and ts.stopped == stopped
