"""Every supported family served on a real local Ray (2 shard groups, tiers smaller than the
model, prefetch on): greedy tokens and their log-probabilities equal transformers' on the same
checkpoint (written by transformers itself), and one routed expert is hot-swapped and served.

Log-probabilities come back through the OpenAI API (`logprobs`), so the fp32 logits are compared
through the whole served path, not only the chosen tokens.
"""

from __future__ import annotations

import pytest
import requests
import torch
from safetensors.torch import save_file

from checkpoints import make_family
from moe_operator.planner.initial import initial_placement
from moe_workers.model.family import SUPPORTED
from moe_workers.model.inprocess import InProcessModel
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


@pytest.fixture(scope="module", params=FAMILIES + list(QUANTIZED))
def served(request, ray_head, tmp_path_factory):
    family, quantize = QUANTIZED.get(request.param, (request.param, None))
    ray = ray_head.connect_driver(namespace=f"family-{request.param}")
    from ray import serve

    root = tmp_path_factory.mktemp(request.param)
    if quantize is None:
        hf = make_family(root / "model", family, num_layers=3, num_experts=8, max_position_embeddings=96)
    else:
        from transformers import AutoModelForCausalLM

        from moe_workers.model.random_init import quantize_checkpoint

        make_family(root / "model", family, num_layers=3, num_experts=8, max_position_embeddings=96, hidden_size=64,
                    intermediate_size=32)
        quantize_checkpoint(root / "model", quantize, block=(8, 8))
        hf = AutoModelForCausalLM.from_pretrained(root / "model", dtype=torch.float32).eval()
    ours = InProcessModel(root / "model")
    cfg = ours.cfg
    placement = initial_placement(cfg.sparse_layers, cfg.num_experts, 2)
    one = cfg.expert_bytes
    tiers = {"hot_budget": 4 * one, "warm_budget": 2 * one, "cold_dir": str(root / "cold"), "idle_demotion_s": 0}
    weights_dir = root / "weights"
    weights_dir.mkdir()
    args = AppArgs(model_path=str(root / "model"), served_model_name=family, num_groups=2, max_batch_size=8,
                   kv_cache_budget_bytes=8 * 2**20, max_queued_requests=16, allowed_weight_roots=[str(weights_dir)])

    def apply(overrides=None):
        deploy(ray_head, [serve_application("fam", "/", args, placement, tiers=tiers, overrides=overrides,
                                             prefetch_lookahead=1)])

    apply()
    try:
        yield dict(family=family, hf=hf, ours=ours, placement=placement, apply=apply, weights_dir=weights_dir,
                   url=f"http://127.0.0.1:{ray_head.serve_http_port}", root=root,
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
    """transformers' greedy tokens (up to and with EOS, where the server stops) and each one's log-probability."""
    ids, tokens, logprobs = list(prompt), [], []
    with torch.no_grad():
        for _ in range(n):
            lp = torch.log_softmax(hf(torch.tensor([ids])).logits[0, -1].double(), dim=-1)
            tok = int(lp.argmax())
            tokens.append(tok)
            logprobs.append(float(lp[tok]))
            ids.append(tok)
            if tok == hf.config.eos_token_id:
                break
    return tokens, logprobs


def test_served_tokens_and_logprobs_equal_transformers(served):
    for prompt in _prompts(4, seed=11):
        want_tokens, want_lp = _reference(served["hf"], prompt, 8)
        choice = _complete(served["url"], prompt, 8, logprobs=1)
        assert choice["token_ids"] == want_tokens
        got_lp = choice["logprobs"]["token_logprobs"]
        assert max(abs(a - b) for a, b in zip(got_lp, want_lp)) < 1e-4


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
