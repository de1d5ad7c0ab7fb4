"""Served (Ingress + 4 ExpertShard groups on a local Ray) against in-process, same checkpoint.

    python bench/serving.py            # hidden 1024, intermediate 3584, 8 experts, top-2, 4 layers
    python bench/serving.py --quick    # a small model, for a smoke run

Prefill: 32 prompts x 256 tokens, one untimed warm-up on each side, then the median of
--prefill-repeats runs. The in-process side runs before and after the served side and the two
are averaged (this machine's speed drifts over minutes). Decode at batch 1, 16 and 64: tokens/s of the decode steps alone (a run with max_tokens=T minus a run with max_tokens=1). Both sides get the same CPU
budget (torch threads reported). Ends with `figure: value` lines.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import json
import os
import statistics
import sys
import tempfile
import time
import types
from pathlib import Path

import requests
import torch

from figures import report, scratch  # the bench directory: this script's own, or its importer's

REPO = Path(__file__).resolve().parents[1]


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="small model and loads, for a smoke run")
    p.add_argument("--family", default="mixtral",
                   help="model family of the random checkpoint: mixtral, qwen3_moe, qwen2_moe, olmoe, deepseek_v3, deepseek_v2, gpt_oss")
    p.add_argument("--groups", type=int, default=4)
    p.add_argument("--threads", type=int, default=2, help="torch threads in-process and per served ingress")
    p.add_argument("--ingress-threads", type=int, default=None,
                   help="torch threads of the served ingress (default: --threads)")
    p.add_argument("--shard-threads", type=int, default=1)
    p.add_argument("--only", choices=["prefill", "deep", "pingpong"], default=None,
                   help="run only this part: prefill of the default shape, or the --layers sweep")
    p.add_argument("--layers", default="4,16,32",
                   help="batch-1 decode sweep over model depth (hidden 256, intermediate 512, 8 experts, top-2, "
                        "2 groups, 32 new tokens); empty to skip")
    p.add_argument("--micro-batches", type=int, default=2,
                   help="served: concurrent micro-batches for steps of >= 256 tokens (1 disables)")
    p.add_argument("--decode-tokens", type=int, default=None)
    p.add_argument("--prefill-repeats", type=int, default=3,
                   help="prefill runs per side; the median is reported (this machine varies by 10%% run to run)")
    p.add_argument("--serve-env", action="append", default=[], metavar="KEY=VALUE",
                   help="extra env var for the served app's replicas (runtime_env), repeatable")
    p.add_argument("--deep-point", type=int, default=0, help=argparse.SUPPRESS)  # one depth, in a subprocess
    p.add_argument("--deep-threads", type=int, default=1,
                   help="depth sweep: torch threads in-process and of the served ingress (1: the app's default, and "
                        "the faster setting for batch-1 decode on both sides)")
    p.add_argument("--deep-rounds", type=int, default=5, help="depth sweep: interleaved rounds per depth")
    p.add_argument("--deep-channels", default="shm,unix,tcp",
                   help="depth sweep: how the ingress reaches its shard replicas (all on one node), each measured "
                        "in every round; the first one gives the main figures. shm: frames through shared memory "
                        "set up over the Unix socket (the app's default); unix, tcp: the frames on that socket; all with the app's defaults "
                        "(poll for replies: exchange_spin_us; CPU wake-up latency asked for: cpu_wake_latency_us; small steps "
                        "under SCHED_RR: realtime_priority); "
                        "-spinN: shard replicas poll a shared-memory connection N us (default 200) for the "
                        "next request before sleeping; -sleep: without the poll; -idle: without the wake-up latency request; -fair: the step "
                        "threads in the fair class (realtime_priority 0) instead of SCHED_RR; -float: the shard "
                        "replicas' threads on every CPU (the kernel places them) instead of the CPUs each took "
                        "(pin_shard_cpus) (modifiers combine: unix-sleep-idle)")
    p.add_argument("--realtime-priority", type=int, default=None,
                   help="default shape: the served app's realtime_priority (default: the app's; 0: decode steps in "
                        "the fair class)")
    p.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="default shape: the served app's step token budget (default: the app's; prefill chunks)")
    p.add_argument("--cache-dir", default=os.environ.get("MOE_BENCH_CACHE", str(Path(tempfile.gettempdir()) / "moe-bench")))
    p.add_argument("--out", default=str(REPO / "bench" / "results" / "serving.json"))
    return p.parse_args()


def model_shape(quick: bool) -> dict:
    if quick:
        return dict(vocab_size=4096, hidden_size=256, intermediate_size=512, num_layers=2, num_heads=8,
                    num_kv_heads=2, num_experts=8, top_k=2, max_position_embeddings=512)
    return dict(vocab_size=32000, hidden_size=1024, intermediate_size=3584, num_layers=4, num_heads=16,
                num_kv_heads=4, num_experts=8, top_k=2, max_position_embeddings=512)


def ensure_checkpoint(cache_dir: str, shape: dict, family: str = "mixtral") -> Path:
    from moe_workers.model.random_init import write_random_checkpoint

    name = f"{family}-" + "-".join(f"{k[:3]}{v}" for k, v in shape.items())
    path = Path(cache_dir) / name
    if not (path / "config.json").exists():
        print(f"writing checkpoint {path} ...", flush=True)
        write_random_checkpoint(path, family, router_scale=10.0, **shape)
    return path


def prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (n, length), generator=g).tolist()


def cpu_ticks() -> tuple[int, int]:
    """(busy, total) jiffies of the whole machine, from /proc/stat: utilization = delta busy / delta total."""
    fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = fields[3] + fields[4]
    return sum(fields) - idle, sum(fields)


def process_cpu_seconds() -> dict[str, tuple[float, float, int]]:
    """(user, system) CPU seconds and minor page faults of every process on the machine, keyed 'pid name'."""
    tick = os.sysconf("SC_CLK_TCK")
    out = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:
            continue
        name = text[text.index("(") + 1:text.rindex(")")]
        fields = text[text.rindex(")") + 2:].split()
        out[f"{stat.parent.name} {name}"] = (int(fields[11]) / tick, int(fields[12]) / tick, int(fields[7]))
    return out


def cpu_by_process(before: dict[str, tuple[float, float, int]], after: dict[str, tuple[float, float, int]],
                   top: int = 12) -> list[tuple[str, float, float, int]]:
    """The processes that used the most CPU in between: (name, user + system seconds, system
    seconds, page faults)."""
    spent = []
    for k, (user, system, faults) in after.items():
        user0, system0, faults0 = before.get(k, (0.0, 0.0, 0))
        spent.append((k, user - user0 + system - system0, system - system0, faults - faults0))
    return sorted((s for s in spent if s[1] > 0.05), key=lambda s: -s[1])[:top]


def utilization(before: tuple[int, int], after: tuple[int, int]) -> float:
    return (after[0] - before[0]) / max(1, after[1] - before[1])


def median_run(runs: list[dict], warmup: dict) -> dict:
    """The run with the median prefill time (its own figures kept together), plus every run's
    time and the untimed warm-up's (the first full prefill of a process touches its KV cache and
    heap pages for the first time: a server pays that once, not per request)."""
    ordered = sorted(runs, key=lambda r: r["prefill_s"])
    return {**ordered[(len(ordered) - 1) // 2], "prefill_runs_s": [r["prefill_s"] for r in runs],
            "prefill_warmup_s": warmup["prefill_s"]}


# -- in-process ------------------------------------------------------------------------------------


def run_inprocess(path: Path, work: dict, threads: int) -> dict:
    from moe_workers.model.dense import Chunk
    from moe_workers.model.inprocess import InProcessModel

    torch.set_num_threads(threads)
    model = InProcessModel(path, max_len=512, max_sequences=max([work["prefill_n"], *work["decode_batches"]]))
    model.generate([[5, 6, 7]], max_tokens=2)  # warm-up
    out = {}
    ps = prompts(work["prefill_n"], work["prefill_len"], model.cfg.vocab_size, 1)
    runs = []
    for _ in range(1 + work["prefill_repeats"] if work["prefill_n"] else 0):  # the first is a warm-up, on both sides
        slots = [model.cache.allocate() for _ in ps]
        t0, c0 = time.perf_counter(), cpu_ticks()
        model.step([Chunk(s, 0, p) for s, p in zip(slots, ps)])
        runs.append({"prefill_s": time.perf_counter() - t0, "prefill_cpu_utilization": utilization(c0, cpu_ticks())})
        for s in slots:
            model.cache.release(s)
    if runs:
        out.update(median_run(runs[1:], warmup=runs[0]))
        out["prefill_tps"] = work["prefill_n"] * work["prefill_len"] / out["prefill_s"]
    for b in work["decode_batches"]:
        ps = prompts(b, 8, model.cfg.vocab_size, 2)
        tps = []
        for _ in range(work.get("decode_repeats", 1)):
            t0 = time.perf_counter()
            model.generate(ps, max_tokens=1)
            t1 = time.perf_counter()
            model.generate(ps, max_tokens=work["decode_tokens"])
            t2 = time.perf_counter()
            tps.append(b * (work["decode_tokens"] - 1) / ((t2 - t1) - (t1 - t0)))
        out[f"decode{b}_tps"] = statistics.median(tps)
        out[f"decode{b}_runs_tps"] = tps
    import resource
    out["peak_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return out


# -- served ----------------------------------------------------------------------------------------


def _post(url: str, body: dict) -> dict:
    resp = requests.post(url + "/v1/completions", json=body, timeout=3600)
    resp.raise_for_status()
    return resp.json()


def _concurrent(url: str, bodies: list[dict]) -> float:
    t0 = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(len(bodies)) as pool:
        list(pool.map(lambda b: _post(url, b), bodies))
    return time.perf_counter() - t0


@contextlib.contextmanager
def served_app(path: Path, groups: int, threads: int, shard_threads: int, num_layers: int, num_experts: int,
               micro_batches: int, serve_env: dict[str, str], max_batch: int, realtime_priority: int | None = None,
               max_num_batched_tokens: int | None = None):
    """The bench app on a fresh local Ray head: (url, stats(), redeploy(**options)) with stats()
    the ingress' engine figures and each shard's status, and redeploy() the same app with other
    in-place options of `serve_application` (e.g. capacity_factor), applied by Serve's
    reconfigure without a restart, once Serve reports the app running again."""
    from moe_operator.backends.ray_rest import RayServeClient
    from moe_operator.standalone.local_ray import LocalRayHead
    from moe_workers.serve.config import AppArgs, serve_application

    head = LocalRayHead(work_dir=scratch("moe-bench-ray-"), num_cpus=8).start()
    try:
        ray = head.connect_driver(namespace="bench")
        from ray import serve

        from moe_workers.model.config import MoEConfig

        sparse = MoEConfig.from_dir(path).sparse_layers  # dense MLP layers have no experts to place
        placement = {f"ExpertShard-{g}": [f"{l}.{e}" for l in sparse for e in range(num_experts)
                                          if e % groups == g] for g in range(groups)}
        # prefix caching off: the in-process side computes every prompt, and the prefill runs repeat
        # their prompts (bench/engine.py measures the cache itself)
        args = AppArgs(model_path=str(path), served_model_name="bench", num_groups=groups, max_batch_size=max_batch,
                       kv_cache_budget_bytes=2 * 2**30, max_queued_requests=256, max_model_len=512,
                       prefix_caching=False,
                       **({} if max_num_batched_tokens is None else {"max_num_batched_tokens": max_num_batched_tokens}),
                       ingress_num_cpus=1, shard_num_cpus=1, torch_threads=shard_threads,
                       ingress_torch_threads=threads, micro_batches=micro_batches,
                       **({} if realtime_priority is None else {"realtime_priority": realtime_priority}))
        client = RayServeClient(head.dashboard_url, head.token)
        app = serve_application("bench", "/", args, placement)
        if serve_env:
            app["runtime_env"]["env_vars"].update(serve_env)
        client.put({"http_options": {"host": "127.0.0.1", "port": head.serve_http_port}, "applications": [app]})
        client.wait_running(["bench"], timeout_s=900)
        url = f"http://127.0.0.1:{head.serve_http_port}"
        ingress = serve.get_app_handle("bench")
        shards = [serve.get_deployment_handle(f"ExpertShard-{g}", app_name="bench") for g in range(groups)]

        def stats():
            return ingress.engine_stats.remote().result(), [s.status.remote().result() for s in shards]

        def redeploy(**options):
            client.put({"http_options": {"host": "127.0.0.1", "port": head.serve_http_port},
                        "applications": [{**app, "deployments": serve_application(
                            "bench", "/", args, placement, **options)["deployments"]}]})
            client.wait_running(["bench"], timeout_s=300)

        _post(url, {"prompt": [5, 6, 7], "max_tokens": 2, "temperature": 0})  # warm-up
        # the app's steady state: its warm spare worker starts (importing torch, seconds of CPU)
        # once the node has settled, which would otherwise land in the first measured rounds
        from chaos import wait_spares

        status = types.SimpleNamespace(status=lambda: requests.get(url + "/moe/v1/status", timeout=10).json())
        print(f"warm spares ready after {wait_spares(status, args.warm_spares)} s", flush=True)
        yield url, stats, redeploy
        client.delete_all()
    finally:
        # the driver leaves before its head stops, on an error too: a driver left connected
        # exits on its own after a minute without the head, before Python prints the error
        import ray

        ray.shutdown()
        head.stop()


def run_served(path: Path, work: dict, groups: int, threads: int, shard_threads: int, vocab: int, num_layers: int,
               num_experts: int, micro_batches: int, serve_env: dict[str, str], realtime_priority: int | None = None,
               max_num_batched_tokens: int | None = None) -> dict:
    batch = max([work["prefill_n"], *work["decode_batches"]])
    with served_app(path, groups, threads, shard_threads, num_layers, num_experts, micro_batches, serve_env,
                    batch, realtime_priority, max_num_batched_tokens) as (url, stats, _):
        out = {}
        ps = prompts(work["prefill_n"], work["prefill_len"], vocab, 1)
        runs = []
        for _ in range(1 + work["prefill_repeats"] if work["prefill_n"] else 0):  # the first is a warm-up
            e0, s0 = stats()
            c0, p0 = cpu_ticks(), process_cpu_seconds()
            run = {"prefill_s": _concurrent(url, [{"prompt": p, "max_tokens": 1, "temperature": 0} for p in ps])}
            run["prefill_cpu_utilization"] = utilization(c0, cpu_ticks())
            run["prefill_cpu_by_process"] = cpu_by_process(p0, process_cpu_seconds())
            e1, s1 = stats()
            shard_compute = [b_["compute_s"] - a_["compute_s"] for a_, b_ in zip(s0, s1)]
            run["prefill_shard_cpu_s"] = [b_["compute_cpu_s"] - a_["compute_cpu_s"] for a_, b_ in zip(s0, s1)]
            run["prefill_ingress_cpu_s"] = {"process": e1["cpu_s"] - e0["cpu_s"],
                                            "dense_thread": e1["dense_cpu_s"] - e0["dense_cpu_s"]}
            run["prefill_breakdown"] = {"wall_s": run["prefill_s"], "dense_s": e1["dense_s"] - e0["dense_s"],
                                        "expert_wait_s": e1["experts_s"] - e0["experts_s"],
                                        "shard_compute_max_s": max(shard_compute),
                                        "shard_compute_sum_s": sum(shard_compute), "steps": e1["steps"] - e0["steps"]}
            runs.append(run)
        if runs:
            out.update(median_run(runs[1:], warmup=runs[0]))
            out["prefill_tps"] = work["prefill_n"] * work["prefill_len"] / out["prefill_s"]
        for b in work["decode_batches"]:
            ps = prompts(b, 8, vocab, 2)
            tps = []
            for _ in range(work.get("decode_repeats", 1)):
                one = _concurrent(url, [{"prompt": p, "max_tokens": 1, "temperature": 0} for p in ps])
                e0, s0 = stats()
                full = _concurrent(url, [{"prompt": p, "max_tokens": work["decode_tokens"], "temperature": 0,
                                          "seed": 0} for p in ps])
                e1, s1 = stats()
                tps.append(b * (work["decode_tokens"] - 1) / (full - one))
            out[f"decode{b}_tps"] = statistics.median(tps)
            out[f"decode{b}_runs_tps"] = tps
            shard_compute = [b_["compute_s"] - a_["compute_s"] for a_, b_ in zip(s0, s1)]
            out[f"decode{b}_breakdown"] = {
                "wall_s": full,
                "dense_s": e1["dense_s"] - e0["dense_s"],
                "expert_wait_s": e1["experts_s"] - e0["experts_s"],
                "shard_compute_max_s": max(shard_compute),
                "shard_compute_sum_s": sum(shard_compute),
                "steps": e1["steps"] - e0["steps"],
            }
        e, s = stats()
        out["peak_rss_bytes"] = {"Ingress": e["peak_rss_bytes"], **{x["group"]: x["peak_rss_bytes"] for x in s}}
        out["ingress_dense_bytes"] = e["dense_bytes"]
        out["pids"] = {"Ingress": e["pid"], "shards": {x["group"]: x["pid"] for x in s}}
        out["shard_expert_bytes"] = {x["group"]: x["bytes"] for x in s}
        return out


def print_breakdown(title: str, bd: dict) -> None:
    print(f"\nwhere served {title} time goes ({bd['steps']} steps, {bd['wall_s']:.2f} s wall):")
    print(f"  dense compute (ingress)          {bd['dense_s']:7.2f} s")
    print(f"  waiting on expert calls           {bd['expert_wait_s']:7.2f} s (summed over micro-batches)")
    print(f"    of which slowest shard compute  {bd['shard_compute_max_s']:7.2f} s (sum over shards {bd['shard_compute_sum_s']:.2f} s)")
    print(f"    dispatch overhead (wait - slowest compute) {bd['expert_wait_s'] - bd['shard_compute_max_s']:7.2f} s")


def inprocess_ms_per_token(model, prompt: list[int], tokens: int) -> float:
    """Batch-1 decode in process: ms a token after the first (a 1-token run subtracted)."""
    t0 = time.perf_counter()
    model.generate([prompt], max_tokens=1)
    t1 = time.perf_counter()
    model.generate([prompt], max_tokens=tokens)
    return ((time.perf_counter() - t1) - (t1 - t0)) / (tokens - 1) * 1000


def wait_until_serving(proc, log: Path, timeout_s: float = 600) -> None:
    """Until `moectl up` (its process and its log file) says it serves; RuntimeError with the
    log's tail when it exits, refuses the manifest or takes longer."""
    deadline = time.monotonic() + timeout_s
    while "is serving at" not in log.read_text():
        if proc.poll() is not None or time.monotonic() > deadline or "InvalidSpec" in log.read_text():
            raise RuntimeError("moectl up did not serve: " + log.read_text()[-3000:])
        time.sleep(0.5)


def deep_point(a, n: int) -> dict:
    """Batch-1 decode of one model depth, served against in-process, interleaved: the two sides
    alternate --deep-rounds times in one window (this machine's speed drifts by 20-30% over
    minutes, which a before/after pair would read as a ratio); figures are medians over rounds."""
    from moe_workers.model.inprocess import InProcessModel

    shape = dict(vocab_size=4096, hidden_size=256, intermediate_size=512, num_layers=n, num_heads=8,
                 num_kv_heads=2, num_experts=8, top_k=2, max_position_embeddings=512)
    tokens = 33
    path = ensure_checkpoint(a.cache_dir, shape, a.family)
    print(f"\ndepth sweep: {n} layers ({shape}); torch threads {a.deep_threads} on both sides", flush=True)
    torch.set_num_threads(a.deep_threads)
    model = InProcessModel(path, max_len=512, max_sequences=2)
    prompt = [5, 6, 7]
    model.generate([prompt], max_tokens=4)  # warm-up

    def local_ms() -> float:
        return inprocess_ms_per_token(model, prompt, tokens)

    rounds = []
    with served_app(path, 2, a.deep_threads, a.shard_threads, n, shape["num_experts"], a.micro_batches,
                    dict(kv.split("=", 1) for kv in a.serve_env), 8) as (url, stats, _):
        body = {"prompt": prompt, "temperature": 0}

        def served_ms() -> tuple[float, dict]:
            one = _concurrent(url, [{**body, "max_tokens": 1}])
            e0, s0 = stats()
            full = _concurrent(url, [{**body, "max_tokens": tokens}])
            e1, s1 = stats()
            steps = e1["steps"] - e0["steps"]
            per_step = {"loop_ms": ((e1["step_s"] - e0["step_s"]) - (e1["forward_s"] - e0["forward_s"])) / steps * 1000,
                        "dense_ms": (e1["dense_s"] - e0["dense_s"]) / steps * 1000,
                        "dense_cpu_ms": (e1["dense_cpu_s"] - e0["dense_cpu_s"]) / steps * 1000,
                        "experts_ms": (e1["experts_s"] - e0["experts_s"]) / steps * 1000,
                        "shard_compute_ms": max(b["compute_s"] - a_["compute_s"] for a_, b in zip(s0, s1)) / steps * 1000,
                        "shard_handle_ms": max(b["channel"]["handle_s"] - a_["channel"]["handle_s"]
                                               for a_, b in zip(s0, s1)) / steps * 1000}
            return (full - one) / (tokens - 1) * 1000, per_step

        from ray import serve

        from moe_workers.serve.config import CPU_WAKE_LATENCY_US, EXCHANGE_SPIN_US, REALTIME_PRIORITY
        from moe_workers.serve.cpus import pin_process

        ingress = serve.get_app_handle("bench")
        shard_handles = [serve.get_deployment_handle(f"ExpertShard-{g}", app_name="bench") for g in range(2)]
        channels = a.deep_channels.split(",")

        def use(channel: str) -> None:
            way, *mods = channel.split("-")
            spin = 0 if "sleep" in mods else EXCHANGE_SPIN_US
            wake = None if "idle" in mods else CPU_WAKE_LATENCY_US
            rt = 0 if "fair" in mods else REALTIME_PRIORITY
            ingress.tune_channel.remote(local=way in ("unix", "shm"), spin_us=spin, wake_latency_us=wake,
                                        realtime_priority=rt, shared_memory=way == "shm").result()
            shard_spin = next((int(m[len("spin"):] or 200) for m in mods if m.startswith("spin")), 0)
            for h in shard_handles:
                h.tune_channel.remote(wake, rt, shard_spin).result()
            for shard in stats()[1]:  # -float: undo the pinning from here, for this round
                pin_process(shard["cpu_affinity"]["cpus"] if "float" not in mods and shard["cpu_affinity"]["cpus"]
                            else sorted(os.sched_getaffinity(0)), shard["pid"])
            time.sleep(0.5)  # the wake-latency request is taken or dropped by a background thread

        for channel in channels:  # warm-up, each way
            use(channel)
            served_ms()
            wake = [sh["channel"]["wake_latency"] for sh in stats()[1]]
            cpus = [sh["cpu_affinity"] for sh in stats()[1]]
            print(f"  {channel}: shards' CPU wake-up latency request {wake}; CPUs taken {cpus}", flush=True)
        from moe_workers.transport.realtime import Realtime

        rr = Realtime(REALTIME_PRIORITY, torch_threads=a.deep_threads)

        def local_rr_ms() -> float:
            """In-process with this thread under SCHED_RR as the served app's step threads run:
            the reference given the same claim on the CPU (nan where it cannot be taken)."""
            rr.enter(1)
            try:
                return local_ms() if not rr.error else float("nan")
            finally:
                rr.leave()

        for _ in range(a.deep_rounds):
            lm = local_ms()
            lm_rr = local_rr_ms()
            rnd = {"in_process_ms": lm, "in_process_rr_ms": lm_rr, "by_channel": {}}
            for channel in channels:
                use(channel)
                sm, per_step = served_ms()
                rnd["by_channel"][channel] = {"served_ms": sm, "ratio": lm / sm, "dispatch_ms_per_layer": (sm - lm) / n,
                                              "served_per_step": per_step}
                print(f"  round: in-process {lm:.2f} ms/token ({lm_rr:.2f} under SCHED_RR), served over {channel} {sm:.2f} ms/token ({lm / sm:.2f}); "
                      "per step " + ", ".join(f"{k} {v:.2f}" for k, v in per_step.items()), flush=True)
            rnd.update(rnd["by_channel"][channels[0]])
            rounds.append(rnd)
    med = lambda k, c=channels[0]: statistics.median(r["by_channel"][c][k] for r in rounds)  # noqa: E731
    lm_rr = statistics.median(r["in_process_rr_ms"] for r in rounds)
    served = med("served_ms")
    return {"layers": n, "channel": channels[0], "in_process_ms_per_token": statistics.median(r["in_process_ms"] for r in rounds),
            "in_process_rr_ms_per_token": lm_rr, "ratio_vs_rr": lm_rr / served, "dispatch_ms_per_layer_vs_rr": (served - lm_rr) / n,
            "served_ms_per_token": med("served_ms"), "ratio": med("ratio"), "dispatch_ms_per_layer": med("dispatch_ms_per_layer"),
            "by_channel": {c: {"served_ms_per_token": med("served_ms", c), "ratio": med("ratio", c),
                               "dispatch_ms_per_layer": med("dispatch_ms_per_layer", c),
                               "loop_ms_per_step": statistics.median(r["by_channel"][c]["served_per_step"]["loop_ms"]
                                                                     for r in rounds)} for c in channels},
            "rounds": rounds}


def pingpong(a, layers: int, batches: list[int], rounds: int) -> tuple[list[dict], dict]:
    """Decode at each batch with ping-pong micro-batches (every step of 8 or more tokens split in
    two halves whose attention and experts interleave) against unsplit steps, alternating in
    one window on one served app (the depth sweep's model: hidden 256, 8 experts top-2, 2 groups);
    medians over rounds."""
    shape = dict(vocab_size=4096, hidden_size=256, intermediate_size=512, num_layers=layers, num_heads=8,
                 num_kv_heads=2, num_experts=8, top_k=2, max_position_embeddings=512)
    path = ensure_checkpoint(a.cache_dir, shape, a.family)
    tokens = a.decode_tokens or 16
    print(f"\nping-pong micro-batches: {layers} layers ({shape}), {a.micro_batches} micro-batches, "
          f"{tokens} new tokens, ingress threads {a.deep_threads}", flush=True)
    rows, figures = [], {}
    with served_app(path, 2, a.deep_threads, a.shard_threads, layers, shape["num_experts"], a.micro_batches,
                    dict(kv.split("=", 1) for kv in a.serve_env), max(batches)) as (url, stats, _):
        from ray import serve

        ingress = serve.get_app_handle("bench")

        def decode_tps(b: int, split: bool) -> float:
            ingress.tune_steps.remote(8 if split else 1 << 30).result()
            ps = prompts(b, 8, shape["vocab_size"], 2)
            one = _concurrent(url, [{"prompt": p, "max_tokens": 1, "temperature": 0} for p in ps])
            full = _concurrent(url, [{"prompt": p, "max_tokens": tokens, "temperature": 0} for p in ps])
            return b * (tokens - 1) / (full - one)

        for b in batches:
            decode_tps(b, True), decode_tps(b, False)  # warm-up
            on, off = [], []
            for _ in range(rounds):
                on.append(decode_tps(b, True))
                off.append(decode_tps(b, False))
                print(f"  batch {b}: ping-pong {on[-1]:.1f} tok/s, unsplit {off[-1]:.1f} tok/s "
                      f"({on[-1] / off[-1]:.3f})", flush=True)
            ratio = statistics.median(x / y for x, y in zip(on, off))
            rows.append({"batch": b, "layers": layers, "on_tps": on, "off_tps": off, "ratio": ratio})
            figures[f"pingpong-over-unsplit-decode{b}-{layers}-layers"] = ratio
    return rows, figures


def deep_sweep(a, layer_counts: list[int]) -> tuple[list[dict], dict]:
    """Each depth in a fresh process (a Ray driver cannot reconnect to a second head in one
    process); what dispatch costs per layer."""
    import subprocess

    rows, figures = [], {}
    for n in layer_counts:
        out = scratch("moe-bench-deep-") / "point.json"
        cmd = [sys.executable, __file__, "--deep-point", str(n), "--out", str(out), "--threads", str(a.threads),
               "--shard-threads", str(a.shard_threads), "--cache-dir", a.cache_dir, "--deep-threads", str(a.deep_threads),
               "--deep-rounds", str(a.deep_rounds), "--family", a.family, "--deep-channels", a.deep_channels,
               *(["--ingress-threads", str(a.ingress_threads)] if a.ingress_threads else []),
               *(f"--serve-env={kv}" for kv in a.serve_env)]
        subprocess.run(cmd, check=True)
        row = json.loads(out.read_text())
        rows.append(row)
        figures[f"decode1-ratio-{n}-layers"] = row["ratio"]
        figures[f"dispatch-ms-per-layer-{n}-layers"] = row["dispatch_ms_per_layer"]
        figures[f"decode1-ratio-vs-rr-{n}-layers"] = row["ratio_vs_rr"]
        figures[f"dispatch-ms-per-layer-vs-rr-{n}-layers"] = row["dispatch_ms_per_layer_vs_rr"]
        for channel, by in list(row["by_channel"].items())[1:]:
            figures[f"decode1-ratio-{channel}-{n}-layers"] = by["ratio"]
            figures[f"dispatch-ms-per-layer-{channel}-{n}-layers"] = by["dispatch_ms_per_layer"]
    if rows:
        print(f"\nbatch-1 decode, 32 new tokens, medians over {a.deep_rounds} interleaved rounds:")
        print(f"{'layers':>6} {'channel':>11} {'in-process ms/token':>20} {'served ms/token':>16} {'served/in-process':>18} "
              f"{'dispatch ms/layer':>18} {'loop ms/step':>18}")
        for r in rows:
            for channel, by in r["by_channel"].items():
                print(f"{r['layers']:6} {channel:>11} {r['in_process_ms_per_token']:20.2f} {by['served_ms_per_token']:16.2f} "
                      f"{by['ratio']:18.2f} {by['dispatch_ms_per_layer']:18.3f} {by['loop_ms_per_step']:18.3f}")
            print(f"{r['layers']:6} (in-process under SCHED_RR: {r['in_process_rr_ms_per_token']:.2f} ms/token; "
                  f"{r['channel']} against it: ratio {r['ratio_vs_rr']:.2f}, "
                  f"dispatch {r['dispatch_ms_per_layer_vs_rr']:.3f} ms/layer)")
        figures["dispatch-ms-per-layer"] = max(r["dispatch_ms_per_layer"] for r in rows)
    return rows, figures


def main() -> int:
    a = parse_args()
    sys.path.insert(0, str(REPO / "workers"))
    sys.path.insert(0, str(REPO / "operator"))
    layer_counts = [int(n) for n in a.layers.split(",") if n.strip()]
    if a.deep_point:
        Path(a.out).write_text(json.dumps(deep_point(a, a.deep_point)))
        return 0
    if a.only == "pingpong":
        rows, figures = pingpong(a, layer_counts[0] if layer_counts else 4, [16, 64], a.deep_rounds)
        return report(a.out, {"pingpong": rows}, figures)
    if a.only == "deep":
        rows, figures = deep_sweep(a, layer_counts)
        return report(a.out, {"deep": rows}, figures)
    shape = model_shape(a.quick)
    work = (dict(prefill_n=8, prefill_len=64, decode_batches=[1, 4, 8], decode_tokens=a.decode_tokens or 8)
            if a.quick else
            dict(prefill_n=32, prefill_len=256, decode_batches=[1, 16, 64], decode_tokens=a.decode_tokens or 24))
    work["prefill_repeats"] = a.prefill_repeats
    if a.only == "prefill":
        work["decode_batches"] = []
    ingress_threads = a.ingress_threads or a.threads
    path = ensure_checkpoint(a.cache_dir, shape, a.family)
    print(f"model {a.family} {shape}\nwork {work}\ntorch threads: in-process {a.threads}; served ingress {ingress_threads}, "
          f"each of {a.groups} shard groups {a.shard_threads}; served micro-batches per step {a.micro_batches}; "
          f"machine cores {os.cpu_count()}", flush=True)
    # in-process before and after the served run, averaged: the machine's speed drifts over the
    # minutes the served run takes, and one side measured at another time reads that as a ratio
    before = run_inprocess(path, work, a.threads)
    served = run_served(path, work, a.groups, ingress_threads, a.shard_threads, shape["vocab_size"], shape["num_layers"],
                        shape["num_experts"], a.micro_batches,
                        dict(kv.split("=", 1) for kv in a.serve_env), a.realtime_priority, a.max_num_batched_tokens)
    after = run_inprocess(path, work, a.threads)
    rates = [k for k, v in before.items() if k.endswith("_tps") and isinstance(v, float)]
    local = {**before, "before": {k: before[k] for k in rates},
             "after": {k: after[k] for k in rates}}
    for key in local["before"]:
        local[key] = (before[key] + after[key]) / 2
    print("in-process tok/s before / after the served run: " + ", ".join(
        f"{k.removesuffix('_tps')} {before[k]:.1f} / {after[k]:.1f}" for k in local["before"]), flush=True)
    rows = [("prefill", "prefill_tps")] + [(f"decode batch {b}", f"decode{b}_tps") for b in work["decode_batches"]]
    print(f"\n{'':18} {'in-process tok/s':>17} {'served tok/s':>13} {'ratio':>7}")
    figures = {}
    for label, key in rows:
        ratio = served[key] / local[key]
        print(f"{label:18} {local[key]:17.1f} {served[key]:13.1f} {ratio:7.2f}")
        figures[key.replace("_tps", "") + "-ratio"] = ratio
    print(f"prefill runs (s, median reported): in-process {', '.join(f'{t:.2f}' for t in local['prefill_runs_s'])} "
          f"(warm-up {local['prefill_warmup_s']:.2f}); served {', '.join(f'{t:.2f}' for t in served['prefill_runs_s'])} "
          f"(warm-up {served['prefill_warmup_s']:.2f})")
    breakdowns = [(f"decode (batch {b})", served[f"decode{b}_breakdown"]) for b in work["decode_batches"][-1:]]
    for title, bd in breakdowns + [("prefill", served["prefill_breakdown"])]:
        print_breakdown(title, bd)
    print(f"\nmachine CPU utilization during prefill: in-process {local['prefill_cpu_utilization']:.0%}, "
          f"served {served['prefill_cpu_utilization']:.0%}; CPU seconds by process (served):")
    print(f"  (shard CPU inside expert calls: {', '.join(f'{c:.2f}' for c in served['prefill_shard_cpu_s'])} s; "
          f"ingress process {served['prefill_ingress_cpu_s']['process']:.2f} s, of which its dense thread "
          f"{served['prefill_ingress_cpu_s']['dense_thread']:.2f} s)")
    roles = {str(served["pids"]["Ingress"]): "Ingress", **{str(pid): g for g, pid in served["pids"]["shards"].items()}}
    for name, seconds, system, faults in served["prefill_cpu_by_process"]:
        pid = name.split()[0]
        label = f"{pid} {roles[pid]}" if pid in roles else name
        print(f"  {label:40} {seconds:7.2f} s (system {system:.2f} s, {faults} page faults)")
    print("\npeak resident memory:")

    print(f"  in-process                 {local['peak_rss_bytes'] / 2**20:9.1f} MiB")
    for name, rss in served["peak_rss_bytes"].items():
        extra = (f" (dense part {served['ingress_dense_bytes'] / 2**20:.1f} MiB)" if name == "Ingress"
                 else f" (experts {served['shard_expert_bytes'][name] / 2**20:.1f} MiB)")
        print(f"  served {name:19} {rss / 2**20:9.1f} MiB{extra}")
    deep_rows, deep_figures = deep_sweep(a, layer_counts) if a.only is None else ([], {})
    figures.update(deep_figures)
    return report(a.out, {"family": a.family, "shape": shape, "work": work, "in_process": local, "served": served,
                          "deep": deep_rows}, figures)


if __name__ == "__main__":
    sys.exit(main())
