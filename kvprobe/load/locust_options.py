"""The locustfile's command-line options: what the runner passes (`LocustRun.command`) and what a
remote worker takes from the master's spawn message. No Locust import: argparse only."""

from __future__ import annotations

from kvprobe.load.records import TOKEN_BASE, TOKEN_RANGE


def add_arguments(parser) -> None:
    """The kvprobe option group on Locust's command line (`--kv-*`; a worker gets the master's values)."""
    g = parser.add_argument_group("kvprobe")
    g.add_argument("--kv-control", default="", help="control file written by the parent")
    g.add_argument("--kv-records-dir", default="", help="directory for the per-process JSONL records")
    g.add_argument("--kv-time-limit", type=float, default=600.0, help="hard limit (s): the shape ends the test")
    g.add_argument("--kv-idle-limit", type=float, default=0.0,
                   help="with it (s): the longest wait for a first level with users; the time limit counts from it")
    g.add_argument("--kv-model", default="", help="model name sent in the request body")
    g.add_argument("--kv-engine", default="vllm", help="request dialect (kvprobe.engines.<name>)")
    # The dialect's COMPLETIONS_PATH, from the runner; a `kvprobe worker` gets it from the master.
    g.add_argument("--kv-path", default="")
    g.add_argument("--kv-prompt-tokens", type=int, default=16)
    g.add_argument("--kv-output-tokens", type=int, default=16)
    g.add_argument("--kv-shared-prefix-tokens", type=int, default=0, help="ids shared by every prompt")
    g.add_argument("--kv-prompt-format", choices=("ids", "text"), default="ids",
                   help="text: one word per id, for a router that refuses token ids (load/prompts.ids_to_text)")
    g.add_argument("--kv-stream", type=int, default=1)
    g.add_argument("--kv-api-key-env", default="", help="NAME of the env var holding the API key")
    g.add_argument("--kv-seed", type=int, default=0)
    g.add_argument("--kv-run-id", default="run")
    g.add_argument("--kv-workers", type=int, default=1, help="number of load-generating processes")
    g.add_argument("--kv-token-base", type=int, default=TOKEN_BASE)
    g.add_argument("--kv-token-range", type=int, default=TOKEN_RANGE)
    g.add_argument("--kv-network-timeout", type=float, default=600.0)
    g.add_argument("--kv-start-jitter", type=float, default=0.0,
                   help="each new user waits uniform(0, S) s before its first request (desynchronise)")
    g.add_argument("--kv-transport", choices=("file", "message"), default="file",
                   help="worker: write records to --kv-records-dir, or send them to the master")
    g.add_argument("--kv-expect-workers", type=int, default=0,
                   help="master: collect the records of this many message-mode workers")
