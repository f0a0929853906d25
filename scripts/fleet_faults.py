"""The fleet's drain rule, tried as a user meets it: CPU servers started by hand with the command the project prints,
the trainer on the same cores, faults injected into the servers' process groups.

    .venv/bin/python scripts/fleet_faults.py none kill stop2 stop1

Scenarios (each a fresh run against the same two servers; ``report_to="none"``):

    none    a fleet of two, 40 steps, nothing killed
    kill    a fleet of two, 40 steps, the second server SIGKILLed after step 10 (last: it is not started again)
    stop2   a fleet of two, 30 steps, the second server SIGSTOPped for 60 s after step 5
    stop1   the first server alone, 30 steps, SIGSTOPped for 60 s after step 5

Each prints the run's drains, resent requests, moved groups, time out of service and waited, and the ledger's check
(no prompt position below the frontier trained twice or missing). No sample is dropped as stale
(``max_staleness`` is unbounded), so the ledger names every consumed position.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from grpo_core.checkpoint import ledger_summary, read_ledger
from grpo_core.config import AsyncGRPOConfig
from grpo_core.rewards import accuracy_reward, format_reward
from grpo_core.rollout.concurrency import parse_vllm_metrics
from grpo_core.rollout.routing_client import server_name
from grpo_core.tiny import arithmetic_dataset, build_tiny_model
from grpo_core.training.trainer import AsyncGRPOTrainer
from grpo_core.vllm_server.checks import recommended_command
from grpo_core.vllm_server.control import VLLMControlClient
from grpo_core.vllm_server.process import CPU_KV_CACHE_ENV, free_port

SCENARIOS = {"none": (2, 40, None), "kill": (2, 40, "kill"), "stop2": (2, 30, "stop"), "stop1": (1, 30, "stop")}
FAULT_AFTER_STEP = {"kill": 10, "stop": 5}
STOP_S = 60.0


def run_config(urls: list[str], steps: int, out: Path) -> AsyncGRPOConfig:
    return AsyncGRPOConfig(
        output_dir=str(out), vllm_server_base_url=urls if len(urls) > 1 else urls[0], report_to="none",
        max_steps=steps, learning_rate=1e-4, num_generations=4, per_device_train_batch_size=8,
        max_completion_length=32, save_strategy="no", max_staleness=1_000_000, server_unavailable_timeout_s=300.0,
        # A short queue keeps the worker from generating the whole run ahead while the trainer waits on a push, so
        # the servers have requests in flight when the fault comes.
        max_concurrent_rollouts=16, queue_maxsize=16)


def start_by_hand(command: str, port: int, log: Path) -> subprocess.Popen:
    """``command`` as the project prints it (``VAR=value ... python -m ...``), on 127.0.0.1:``port``, in its own
    process group (the API server and its engine stop and die together)."""
    words = shlex.split(command.replace("\\\n", " "))
    # The printed command leaves the CPU KV-cache size to the machine; without it vLLM reserves 92% of the memory,
    # which a shared machine does not have free. 1 GiB, as the project's own launcher sets (ServerOptions.kv_cache_gib).
    env = {**os.environ, CPU_KV_CACHE_ENV: os.environ.get(CPU_KV_CACHE_ENV, "1")}
    while "=" in words[0] and not words[0].startswith("-"):
        key, value = words.pop(0).split("=", 1)
        env[key] = value
    words[0] = sys.executable if words[0] == "python" else words[0]
    words += ["--host", "127.0.0.1", "--port", str(port)]
    return subprocess.Popen(words, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True)


def wait_answering(url: str, server: subprocess.Popen, timeout_s: float = 1800.0) -> None:
    control = VLLMControlClient(url)
    deadline = time.monotonic() + timeout_s
    try:
        while not control.answers(timeout=2.0):
            if server.poll() is not None:
                raise RuntimeError(f"the server for {url} exited ({server.returncode}); see its log")
            if time.monotonic() > deadline:
                raise TimeoutError(url)
            time.sleep(2.0)
    finally:
        control.close()


def running_requests(url: str, timeout_s: float) -> float:
    """The requests the server at ``url`` runs, once it runs any (0 after ``timeout_s``)."""
    control = VLLMControlClient(url)
    deadline = time.monotonic() + timeout_s
    try:
        while time.monotonic() < deadline:
            running = parse_vllm_metrics(control.metrics_text() or "").num_requests_running or 0
            if running > 0:
                return float(running)
            time.sleep(0.02)
        return 0.0
    finally:
        control.close()


def run_scenario(name: str, model: str, urls: list[str], servers: list[subprocess.Popen], out: Path) -> dict:
    n, steps, fault = SCENARIOS[name]
    config = run_config(urls[:n], steps, out / name)
    trainer = AsyncGRPOTrainer(model, [accuracy_reward, format_reward], train_dataset=arithmetic_dataset()["train"],
                               args=config)
    events: dict[str, float] = {}
    victim = servers[n - 1]

    def inject() -> None:
        while len(trainer.state.log_history) < FAULT_AFTER_STEP[fault]:
            time.sleep(0.05)
        events["running_at_fault"] = running_requests(urls[n - 1], timeout_s=10.0)  # so that work is lost in flight
        events["fault_after_step"] = len(trainer.state.log_history)
        if fault == "kill":
            os.killpg(victim.pid, signal.SIGKILL)
            events["fault_at"] = time.monotonic()
            return
        os.killpg(victim.pid, signal.SIGSTOP)
        events["fault_at"] = time.monotonic()
        time.sleep(STOP_S)
        os.killpg(victim.pid, signal.SIGCONT)
        events["resumed_after_step"] = len(trainer.state.log_history)

    def drained_at() -> None:  # when the trainer first counted the victim out, from the fault (monotonic)
        while fault and "fault_at" not in events or trainer.run.fleet is None:
            time.sleep(0.05)
        member = trainer.run.fleet.members[server_name(urls[n - 1])]
        while member.left_at is None or member.left_at < events["fault_at"]:
            time.sleep(0.05)
        events["out_after_fault_s"] = round(member.left_at - events["fault_at"], 1)

    if fault and n > 1:
        threading.Thread(target=drained_at, daemon=True).start()
    thread = threading.Thread(target=inject, daemon=True) if fault else None
    if thread:
        thread.start()
    started = time.monotonic()
    history = trainer.train()
    wall = time.monotonic() - started
    if thread:
        thread.join(timeout=STOP_S + 10)
    last = history[-1]
    names = [server_name(u) for u in urls[:n]]
    _, records = read_ledger(config.output_dir)
    consumed = [p for r in records for p in r["trained"] + r["dropped_groups"]]
    frontier = records[-1]["frontier"]
    result = {
        "scenario": name, "servers": n, "steps": len(history), "wall_s": round(wall),
        "fleet/drains": last.get("fleet/drains"),
        "rollout/drains_total (worker)": max(h.get("rollout/drains_total", 0.0) for h in history),
        "rollout/resent_requests (sum over steps)": sum(h.get("rollout/resent_requests", 0.0) for h in history),
        "rollout/moved_groups_total": max(h.get("rollout/moved_groups_total", 0.0) for h in history),
        **{f"fleet/{m}/out_s": round(last.get(f"fleet/{m}/out_s", 0.0), 1) for m in names},
        **{f"fleet/{m}/waited_s": round(last.get(f"fleet/{m}/waited_s", 0.0), 1) for m in names},
        **{f"rollout/server/{m}/unhealthy_s": round(max(h.get(f"rollout/server/{m}/unhealthy_s", 0.0)
                                                        for h in history), 1) for m in names},
        "ledger: prompts_trained_twice": ledger_summary(config.output_dir)["prompts_trained_twice"],
        "ledger: positions below the frontier never trained": len(set(range(frontier)) - set(consumed)),
        "frontier": frontier,
        **{f"rollout/server/{m}/groups (sum)": sum(h.get(f"rollout/server/{m}/groups", 0.0) for h in history)
           for m in names},
        **{k: round(v - started, 1) if k.endswith("_at") else v for k, v in events.items()},
    }
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("scenarios", nargs="+", choices=list(SCENARIOS))
    parser.add_argument("--out", default="/tmp/fleet-faults")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model = str(build_tiny_model())
    command = recommended_command(run_config(["http://a:1", "http://b:1"], 1, out / "probe"), model)
    print("the project's command:\n" + command, flush=True)
    ports = [free_port(), free_port()]
    urls = [f"http://127.0.0.1:{p}" for p in ports]
    servers = [start_by_hand(command, p, out / f"server-{i}.log") for i, p in enumerate(ports)]
    try:
        started = time.monotonic()
        for url, server in zip(urls, servers):
            wait_answering(url, server)
        print(f"both servers answer after {time.monotonic() - started:.0f} s", flush=True)
        for name in args.scenarios:
            result = run_scenario(name, model, urls, servers, out)
            print(json.dumps(result), flush=True)
            with (out / "results.jsonl").open("a") as f:
                f.write(json.dumps(result) + "\n")
            if SCENARIOS[name][2] == "kill":
                break  # the killed server is gone: later scenarios would run without it
    finally:
        for server in servers:
            try:
                os.killpg(server.pid, signal.SIGCONT)
                os.killpg(server.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        for server in servers:
            try:
                server.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(server.pid, signal.SIGKILL)


if __name__ == "__main__":
    main()
