"""Every supported family served on a real local Ray (2 shard groups, tiers smaller than the
model, prefetch on): greedy tokens and their log-probabilities equal transformers' on the same
checkpoint (written by transformers itself), and one routed expert is hot-swapped and served.

Log-probabilities come back through the OpenAI API (`logprobs`), so the fp32 logits are compared
through the whole served path, not only the chosen tokens. Each checkpoint carries a byte-level
vocabulary with its family's tool-call markers (and gpt-oss's harmony tokens) as added tokens and
its family's chat template (tests/templates), so a tool call's round trip goes through the openai
client in every family's convention.
"""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import openai
import pytest
import requests
import torch
from safetensors.torch import save_file
from tokenizers import AddedToken, Tokenizer

from checkpoints import make_family, reference_greedy
from moe_operator.planner.initial import initial_placement
from moe_workers.model.family import SUPPORTED
from moe_workers.model.inprocess import InProcessModel
from moe_workers.model.tokenizer import write_byte_tokenizer
from moe_workers.serve.openai.chat import ChatTemplate, write_tokenizer_config
from moe_workers.serve.openai.protocol import ChatMessage
from moe_workers.serve.openai.reasoning import HARMONY, reasoning_format, split
from moe_workers.serve.openai.tools import markers, tool_format
from moe_workers.serve.config import AppArgs, serve_application
from serve_rest import delete_all, deploy
from waiting import wait_for

pytestmark = pytest.mark.ray

FAMILIES = [f for f in SUPPORTED if f != "mixtral"]  # Mixtral: test_serving, test_hotswap
# quantized as the releases ship (blocks of 8: whole blocks at these dims, where transformers' dequant holds)
QUANTIZED = {"deepseek_v3-fp8": ("deepseek_v3", "fp8"), "gpt_oss-mxfp4": ("gpt_oss", "mxfp4")}
SHORT_NAMES = {"w1": "gate_proj.weight", "w2": "down_proj.weight", "w3": "up_proj.weight",
               "gate_up": "gate_up_proj", "gate_up_bias": "gate_up_proj_bias", "down": "down_proj",
               "down_bias": "down_proj_bias"}
TEMPLATES = Path(__file__).resolve().parents[1] / "templates"
TEMPLATE = {"hermes": "qwen3_tools.jinja", "deepseek": "deepseek_v3_tools.jinja", "harmony": "gpt_oss_tools.jinja"}
MAX_LEN = 2048  # room for a template's tool definitions in byte tokens


def _vocabulary(model_dir: Path, family: str) -> tuple[Tokenizer, dict]:
    """The byte tokenizer with the family's markers added as its published vocabulary has them
    (special tokens, but Qwen's <tool_call>); the config overrides that end gpt-oss at <|return|>."""
    tok = Tokenizer.from_file(str(write_byte_tokenizer(model_dir)))
    fmt = tool_format(family)
    # (harmony's channel names are single tokens of gpt-oss's vocabulary too)
    added = dict.fromkeys((HARMONY + ("analysis", "final") if fmt == "harmony" else ()) + tuple(markers(fmt)))
    tok.add_tokens([AddedToken(m, special=fmt != "hermes" and m not in ("analysis", "final")) for m in added])
    tok.save(str(model_dir / "tokenizer.json"))
    write_tokenizer_config(model_dir, (TEMPLATES / TEMPLATE[fmt]).read_text())
    return tok, {"eos_token_id": tok.token_to_id("<|return|>")} if fmt == "harmony" else {}


@pytest.fixture(scope="module", params=FAMILIES + list(QUANTIZED))
def served(request, ray_head, tmp_path_factory):
    family, quantize = QUANTIZED.get(request.param, (request.param, None))
    ray = ray_head.connect_driver(namespace=f"family-{request.param}")
    from ray import serve

    root = tmp_path_factory.mktemp(request.param)
    (root / "model").mkdir()
    tok, eos = _vocabulary(root / "model", family)
    dims = dict(num_layers=3, num_experts=8, max_position_embeddings=MAX_LEN, config_overrides=eos,
                vocab_size=tok.get_vocab_size(with_added_tokens=True))
    if quantize is None:
        hf = make_family(root / "model", family, **dims)
    else:
        from transformers import AutoModelForCausalLM

        from moe_workers.model.random_init import quantize_checkpoint

        make_family(root / "model", family, **dims, hidden_size=64, intermediate_size=32)
        quantize_checkpoint(root / "model", quantize, block=(8, 8))
    if eos:  # as published: generation_config.json ends a turn at a tool call's <|call|> too
        ends = [eos["eos_token_id"], tok.token_to_id("<|call|>")]
        (root / "model" / "generation_config.json").write_text(json.dumps({"eos_token_id": ends}))
        if quantize is None:
            hf.generation_config.eos_token_id = ends
    if quantize is not None:
        hf = AutoModelForCausalLM.from_pretrained(root / "model", dtype=torch.float32).eval()
    ours = InProcessModel(root / "model")
    cfg = ours.cfg
    placement = initial_placement(cfg.sparse_layers, cfg.num_experts, 2)
    one = cfg.expert_bytes
    tiers = {"hot_budget": 4 * one, "warm_budget": 2 * one, "cold_dir": str(root / "cold"), "idle_demotion_s": 0}
    weights_dir = root / "weights"
    weights_dir.mkdir()
    args = AppArgs(model_path=str(root / "model"), served_model_name=family, num_groups=2, max_batch_size=8,
                   kv_cache_budget_bytes=8 * 2**20, max_queued_requests=16, allowed_weight_roots=[str(weights_dir)],
                   max_model_len=MAX_LEN)

    def apply(overrides=None):
        deploy(ray_head, [serve_application("fam", "/", args, placement, tiers=tiers, overrides=overrides,
                                             prefetch_lookahead=1)])

    apply()
    try:
        yield dict(family=family, hf=hf, ours=ours, placement=placement, apply=apply, weights_dir=weights_dir,
                   url=f"http://127.0.0.1:{ray_head.serve_http_port}", root=root, tok=tok,
                   shard=lambda g: serve.get_deployment_handle(g, app_name="fam"))
    finally:
        delete_all(ray_head)
        ray.shutdown()


def _complete(url, prompt, n, **extra):
    resp = requests.post(url + "/v1/completions", json={"prompt": prompt, "max_tokens": n, "temperature": 0,
                                                       **extra}, timeout=120)
    assert resp.status_code == 200, resp.text
    return resp.json()["choices"][0]


def _prompts(count, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 96, (int(n),), generator=g).tolist() for n in torch.randint(3, 40, (count,), generator=g)]


def _reference(hf, prompt, n):
    """transformers' greedy tokens (up to and with an end of sequence, as its generation config
    lists them, where the server stops) and each one's log-probability."""
    ends = hf.generation_config.eos_token_id
    ends = set(ends if isinstance(ends, list) else [ends])
    ids, tokens, logprobs = list(prompt), [], []
    with torch.no_grad():
        for _ in range(n):
            lp = torch.log_softmax(hf(torch.tensor([ids])).logits[0, -1].double(), dim=-1)
            tok = int(lp.argmax())
            tokens.append(tok)
            logprobs.append(float(lp[tok]))
            ids.append(tok)
            if tok in ends:
                break
    return tokens, logprobs


def test_served_tokens_and_logprobs_equal_transformers(served):
    for prompt in _prompts(4, seed=11):
        want_tokens, want_lp = _reference(served["hf"], prompt, 8)
        choice = _complete(served["url"], prompt, 8, logprobs=1)
        assert choice["token_ids"] == want_tokens
        got_lp = choice["logprobs"]["token_logprobs"]
        assert max(abs(a - b) for a, b in zip(got_lp, want_lp)) < 1e-4


ADD = {"type": "function", "function": {
    "name": "add", "description": "Add two numbers",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                                                    "b": {"type": "integer", "minimum": 0, "maximum": 99}},
                   "required": ["a", "b"], "additionalProperties": False}}}


def test_a_tool_call_round_trip_in_the_family_convention_through_the_openai_client(served):
    """A call forced by name comes back as message.tool_calls (the same streamed) whose arguments
    fit the parameters; the call and its result go back through the family's template, and the
    answer is transformers' greedy tokens on that prompt. gpt-oss: its analysis channel is
    reasoning_content, the rest content, as the harmony splitter reads the same tokens."""
    family, tok = served["family"], served["tok"]
    client = openai.OpenAI(base_url=served["url"] + "/v1", api_key="unused", max_retries=0, timeout=120)
    ask = [{"role": "user", "content": "What is 2 + 3?"}]
    kwargs = dict(model=family, messages=ask, tools=[ADD], max_completion_tokens=300, temperature=1.0, seed=7,
                  parallel_tool_calls=False,
                  tool_choice={"type": "function", "function": {"name": "add"}})
    resp = client.chat.completions.create(**kwargs).choices[0]
    assert resp.finish_reason == "tool_calls" and len(resp.message.tool_calls) == 1, resp
    call = resp.message.tool_calls[0]
    assert call.function.name == "add"
    jsonschema.validate(json.loads(call.function.arguments), ADD["function"]["parameters"])
    chunks = list(client.chat.completions.create(**kwargs, stream=True))
    deltas = [d for c in chunks if c.choices for d in c.choices[0].delta.tool_calls or []]
    assert [(d.function.name, d.function.arguments) for d in deltas] == [("add", call.function.arguments)]

    history = ask + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": call.id, "type": "function", "function": {"name": "add", "arguments": call.function.arguments}}]},
        {"role": "tool", "tool_call_id": call.id, "content": "5"}]
    text = ChatTemplate.from_checkpoint(served["root"] / "model").render(
        [ChatMessage.model_validate(m) for m in history], tools=[ADD])
    prompt = tok.encode(text, add_special_tokens=False).ids
    answer = client.chat.completions.create(model=family, messages=history, tools=[ADD], tool_choice="none",
                                            max_completion_tokens=4, temperature=0, extra_body={"ignore_eos": True})
    assert answer.usage.prompt_tokens == len(prompt)
    assert answer.choices[0].model_extra["token_ids"] == reference_greedy(served["hf"], prompt, 4)
    if tool_format(family) != "harmony":
        return
    # random weights biased to harmony's markers and channel names write messages of every kind:
    # each choice's split is the splitter's on its tokens, and some choice has both sides
    fmt = reasoning_format(tok.get_vocab(with_added_tokens=True), family)
    bias = {str(tok.token_to_id(m)): 8 for m in ("<|channel|>", "<|message|>", "<|end|>", "<|start|>",
                                                 "analysis", "final")}
    think = dict(model=family, messages=ask, max_completion_tokens=64, temperature=1.0, seed=3, n=8,
                 logit_bias=bias, extra_body={"ignore_eos": True})
    ask_ids = tok.encode(ChatTemplate.from_checkpoint(served["root"] / "model").render(
        [ChatMessage.model_validate(m) for m in ask]), add_special_tokens=False).ids
    both = 0
    for choice in client.chat.completions.create(**think).choices:
        ids = choice.model_extra["token_ids"]
        reasoning, content = split(fmt, ask_ids, ids, lambda t: tok.decode(t, skip_special_tokens=False))
        assert (choice.message.model_extra.get("reasoning_content") or "") == tok.decode(reasoning)
        assert (choice.message.content or "") == tok.decode(content)
        both += bool(reasoning and content)
    assert both, "no choice wrote both an analysis message and an answer"
    streamed = {}
    for c in client.chat.completions.create(**think, stream=True):
        for ch in c.choices:
            got = streamed.setdefault(ch.index, ["", ""])
            got[0] += (ch.delta.model_extra or {}).get("reasoning_content") or ""
            got[1] += ch.delta.content or ""
    whole = client.chat.completions.create(**think).choices
    assert {i: [(c.message.model_extra.get("reasoning_content") or ""), c.message.content or ""]
            for i, c in enumerate(whole)} == streamed


def test_per_expert_load_is_counted_by_expert_id_on_sparse_layers_only(served):
    _complete(served["url"], _prompts(1, seed=3)[0], 4)
    sparse = {str(layer) for layer in served["ours"].cfg.sparse_layers}
    loads = {}
    for group in served["placement"]:
        loads.update(served["shard"](group).status.remote().result()["load"])
    assert sum(loads.values()) > 0 and {eid.split(".")[0] for eid in loads} <= sparse


def test_hot_swap_of_one_routed_expert_is_served(served):
    ours, cfg = served["ours"], served["ours"].cfg
    layer = cfg.sparse_layers[-1]
    prompt = _prompts(1, seed=5)[0]
    x_counts = served["shard"]("ExpertShard-0").status.remote().result()["load"]
    # an expert of ExpertShard-0 in the last layer whose new weights change this prompt's tokens
    # (the most used first: an expert the prompt never routes to would not show the swap)
    candidates = sorted((e for e in served["placement"]["ExpertShard-0"] if e.startswith(f"{layer}.")),
                        key=lambda e: -x_counts.get(e, 0))
    before = ours.generate([prompt], 6, stop_at_eos=True)[0]
    for eid in candidates:
        key = tuple(int(p) for p in eid.split("."))
        new = {part: (t * 30).contiguous() for part, t in ours.experts.weights[key].items()}
        patched = InProcessModel(served["root"] / "model")
        patched.experts.weights[key] = new
        want = patched.generate([prompt], 6, stop_at_eos=True)[0]
        if want != before:
            break
    else:
        raise AssertionError(f"no expert of {candidates} changes the tokens of {prompt}")
    file = served["weights_dir"] / f"expert-{eid}.safetensors"
    # a file in the compute dtype holds the expert as the bf16 release lays it out (gpt_oss mxfp4
    # computes in [out, in]; its file is transformers' [in, out])
    release = {p: t.t().contiguous() if cfg.experts_out_in and t.dim() == 2 else t for p, t in new.items()}
    save_file({SHORT_NAMES[p]: t for p, t in release.items()}, str(file))
    served["apply"]({eid: {"path": str(file)}})

    def swapped():
        rec = served["shard"]("ExpertShard-0").status.remote().result()["swaps"].get(eid)
        return rec if rec and rec.get("outcome") in ("Serving", "Failed") else None

    try:
        record = wait_for(swapped, timeout_s=60)
    except AssertionError:
        st = served["shard"]("ExpertShard-0").status.remote().result()
        raise AssertionError(f"no swap record for {eid}: swaps {st['swaps']}, experts {st['experts']}")
    assert record["outcome"] == "Serving", record
    assert _complete(served["url"], prompt, 6)["token_ids"] == want


def test_moectl_up_serves_every_family_init_model_writes(tmp_path):
    """`moectl init-model --family F` for each family, then one `moectl up` whose manifest is
    pointed at each checkpoint in turn (re-reconciled on the edit): each served equal to
    transformers on the same files. An unsupported model_type is Ready=False UnsupportedModel,
    naming the supported ones, and the running app keeps serving."""
    import json
    import os

    import yaml
    from transformers import AutoModelForCausalLM

    from moe_operator.standalone.local_ray import free_port
    from moectl_proc import MoectlUp, moectl

    env = {**os.environ, "MOE_STATE_DIR": str(tmp_path / "state")}
    # and the two quantized layouts (fp8 in blocks of 4: whole blocks at these dims, as transformers needs)
    models = [(f, f, ()) for f in SUPPORTED] + [("deepseek_v3-fp8", "deepseek_v3", ("--quantize", "fp8", "--block-size", "4")),
                                                ("gpt_oss-mxfp4", "gpt_oss", ("--quantize", "mxfp4"))]
    for name, family, extra in models:
        out = moectl("init-model", str(tmp_path / "models" / name), "--family", family, "--layers", "3",
                     "--experts", "4", "--hidden", "32", "--intermediate", "32", "--max-len", "128", *extra,
                     env=env).stdout
        assert f"({family}{', ' + extra[1] if extra else ''}, 3 layers x 4 experts" in out
    manifest = {"apiVersion": "serving.moe.io/v1alpha1", "kind": "MoEDeployment", "metadata": {"name": "fam"},
                "spec": {"model": {"path": "models/mixtral"}, "ingress": {"numCpus": 0.25, "kvCacheBudget": "16Mi"},
                         "experts": {"groups": 2, "numCpus": 0.25,
                                     "tiers": {"hot": {"budget": "16Mi"}, "warm": {"budget": "16Mi"}}}}}
    f = tmp_path / "fam.yaml"
    f.write_text(yaml.safe_dump(manifest))
    port = free_port()
    up = MoectlUp(f, port, env, tmp_path / "up.log", "--num-cpus", "2")

    def status():
        return json.loads(moectl("get", "fam", "--local", "-o", "json", env=env).stdout)["status"]

    def ready(s):
        return next(c for c in s.get("conditions", []) if c["type"] == "Ready")

    try:
        up.wait_serving()
        url = f"http://127.0.0.1:{port}"
        prompt = [40, 41, 42, 43, 44]
        for generation, (family, _, _) in enumerate(models, 1):
            if generation > 1:
                manifest["spec"]["model"]["path"] = f"models/{family}"
                f.write_text(yaml.safe_dump(manifest))
                wait_for(lambda: (s := status()).get("observedGeneration") == generation
                         and ready(s)["reason"] == "Serving", what=f"{family} served")
            hf = AutoModelForCausalLM.from_pretrained(tmp_path / "models" / family, dtype=torch.float32).eval()
            want, _ = _reference(hf, prompt, 6)
            got = _complete(url, prompt, 6)["token_ids"]
            assert got == want, family
        cfg_file = tmp_path / "models" / models[-1][0] / "config.json"  # the one served now
        cfg_file.write_text(json.dumps({**json.loads(cfg_file.read_text()), "model_type": "jamba"}))
        f.write_text(yaml.safe_dump({**manifest, "metadata": {"name": "fam", "labels": {"edit": "1"}}}))
        refused = wait_for(lambda: (s := status()) and ready(s)["reason"] == "UnsupportedModel" and s,
                           what="UnsupportedModel")
        assert ready(refused)["status"] == "False"
        assert "model_type 'jamba' is not supported (supported: mixtral, qwen3_moe" in ready(refused)["message"]
        assert len(_complete(url, prompt, 2)["token_ids"]) >= 1  # the last good app keeps serving
    finally:
        up.stop()
