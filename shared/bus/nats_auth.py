"""A locked bus: one NATS user per service, allowed only the subjects it needs, passwords generated.

`write(folder)` makes `nats-auth.conf` (the server's accounts and users) and `nats-users.json`
(what each service connects as), both 0600. A service finds its password through
SY_NATS_AUTH_FILE and SY_NATS_USER (shared/bus/connection.py), never on a command line. `make run` and
compose generate them; docs/configuration.md lists who may do what.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
from pathlib import Path

from shared.wire import subjects

P = subjects.PREFIX
INBOX = "_INBOX.>"  # replies to a client's own requests
# the registry (KV and Object Store) and the stored Responses live in JetStream
JETSTREAM = ["$JS.API.>", "$KV.>", "$O.>", "$JS.ACK.>", "$JS.FC.>"]
REPLIES = "allow_responses"  # may answer requests sent to it (the reply subject only, once)


def stats_of(service: str) -> list[str]:
    """A service answers micro's stats requests (shared/bus/endpoints.py)."""
    return [subjects.service_stats(service, ""), subjects.service_stats(service)]


# who may publish (pub) and subscribe (sub) to what; a model name and a worker id are one token
PERMISSIONS: dict[str, dict[str, list[str] | bool]] = {
    "api": {
        "pub": [f"{P}.*.submit", f"{P}.*.abort", f"{P}.*.stats", f"{P}.*.sleep", f"{P}.*.lora", f"{P}.*.kv_held",
                f"{P}.kv.stats",
                subjects.WORKERS_RESEND,
                subjects.CLIENTS_HEARTBEAT, f"{P}.responses.>", f"{P}.batches.>", f"{P}.background.>",
                f"{P}.custom.*.predict", subjects.INFERENCE_LOGS, *JETSTREAM],
        "sub": [f"{P}.background.>", f"{P}.out.>", subjects.SCHEDULERS_HEARTBEAT, subjects.MODEL_LIMITS, INBOX, *JETSTREAM],
        REPLIES: True,  # a gateway answers the cancel of a background response it runs
    },
    "client": {  # an internal team's process on the bus (shared/bus/client.py): submit, read its tokens
        "pub": [f"{P}.*.submit", f"{P}.*.abort", f"{P}.*.stats", f"{P}.*.kv_held", subjects.WORKERS_RESEND,
                subjects.CLIENTS_HEARTBEAT],
        "sub": [f"{P}.out.>", subjects.SCHEDULERS_HEARTBEAT, subjects.MODEL_LIMITS, INBOX],
    },
    "custom": {  # a custom model's runtime, running the user's code: its engine requests, its predicts
        "pub": [f"{P}.*.submit", f"{P}.*.abort", subjects.WORKERS_RESEND, subjects.CLIENTS_HEARTBEAT],
        "sub": [f"{P}.out.>", f"{P}.custom.*.predict", subjects.SCHEDULERS_HEARTBEAT, INBOX],
        REPLIES: True,
    },
    "scheduler": {
        "pub": [f"{P}.worker.*.step", f"{P}.worker.*.sleep", f"{P}.worker.*.lora", f"{P}.worker.*.kv_fetch", f"{P}.out.>",
                f"{P}.kv.events.*", subjects.KV_LOOKUP, subjects.MODEL_LIMITS,
                subjects.WORKERS_DISCOVER, subjects.SCHEDULERS_HEARTBEAT, *JETSTREAM],
        "sub": [f"{P}.*.submit", f"{P}.*.abort", f"{P}.*.stats", f"{P}.*.sleep", f"{P}.*.lora", f"{P}.*.kv_held",
                subjects.WORKERS_HELLO, subjects.WORKERS_HEARTBEAT,
                subjects.KV_RESYNC, subjects.CLIENTS_HEARTBEAT, INBOX, *JETSTREAM, *stats_of("scheduler")],
        REPLIES: True,
    },
    "worker": {
        "pub": [f"{P}.out.>", f"{P}.tokens.*", subjects.WORKERS_HELLO, subjects.WORKERS_HEARTBEAT, f"{P}.kv.tier.*.read",
                *JETSTREAM],
        "sub": [f"{P}.worker.*.step", f"{P}.worker.*.sleep", f"{P}.worker.*.lora", f"{P}.worker.*.kv_fetch",
                f"{P}.kv.tier.*.read", subjects.WORKERS_DISCOVER, subjects.WORKERS_RESEND, INBOX, *JETSTREAM,
                *stats_of("worker")],
        REPLIES: True,
    },
    "agent": {  # it starts worker replicas, which connect as "worker"
        "pub": [f"{P}.*.stats", *JETSTREAM],
        "sub": [subjects.WORKERS_HELLO, INBOX, *JETSTREAM],
    },
    "kvcache": {
        "pub": [subjects.KV_RESYNC],
        "sub": [subjects.KV_EVENTS_ALL, subjects.KV_LOOKUP, subjects.KV_STATS, INBOX, *stats_of("kvcache")],
        REPLIES: True,
    },
    "admin": {"pub": [">"], "sub": [">"]},  # operators and the test suite
}
CONF_FILE, USERS_FILE = "nats-auth.conf", "nats-users.json"


def _user_block(name: str, password: str) -> str:
    rules = PERMISSIONS[name]
    responses = "\n        allow_responses: true" if rules.get(REPLIES) else ""
    return (f'      {{ user: "{name}", password: "{password}", permissions: {{\n'
            f"        publish: {{ allow: {json.dumps(rules['pub'])} }}\n"
            f"        subscribe: {{ allow: {json.dumps(rules['sub'])} }}{responses}\n      }} }}")


def write(folder: str | Path) -> Path:
    """Fresh passwords for every service; returns the server's config file (to include or pass with -c)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    passwords = {name: secrets.token_urlsafe(24) for name in PERMISSIONS}
    users = ",\n".join(_user_block(name, pw) for name, pw in passwords.items())
    conf = f"accounts {{\n  SWITCHYARD {{\n    jetstream: enabled\n    users: [\n{users}\n    ]\n  }}\n}}\n"
    for name, text in ((CONF_FILE, conf), (USERS_FILE, json.dumps(passwords))):
        path = folder / name
        path.write_text("")
        path.chmod(0o600)
        path.write_text(text)
    return folder / CONF_FILE


def credentials(user: str | None = None, auth_file: str | None = None) -> tuple[str, str] | None:
    """(user, password) from SY_NATS_AUTH_FILE for SY_NATS_USER (or the arguments); None if unset."""
    user = user or os.environ.get("SY_NATS_USER")
    auth_file = auth_file or os.environ.get("SY_NATS_AUTH_FILE")
    if not user or not auth_file:
        return None
    passwords = json.loads(Path(auth_file).read_text())
    if user not in passwords:
        raise ValueError(f"{auth_file} has no NATS user {user!r} (it has {sorted(passwords)})")
    return user, passwords[user]


def env_for(user: str, auth_folder: str | Path) -> dict[str, str]:
    """What a service's environment needs to connect as `user`."""
    return {"SY_NATS_USER": user, "SY_NATS_AUTH_FILE": str(Path(auth_folder) / USERS_FILE)}


def url_with_login(url: str, user: str, auth_folder: str | Path) -> str:
    """nats://user:password@host:port, for tools and tests (a service reads its password from the file);
    each server's of a cluster's comma-separated list."""
    _, password = credentials(user, str(Path(auth_folder) / USERS_FILE))
    return ",".join(f"{scheme}://{user}:{password}@{rest}" for scheme, rest in
                    (one.strip().split("://", 1) for one in url.split(",")))


def user_of(service: str) -> str:
    """The NATS user a launched service connects as ("worker-0" is a worker, "scheduler-1" a scheduler,
    "api-1" a gateway)."""
    return next((user for user in ("worker", "scheduler", "api") if service.startswith(user)), service)


def main(argv: list[str] | None = None) -> None:
    """compose's init step and deploy/k8s's first: `python -m shared.bus.nats_auth FOLDER` writes the bus's
    users there (kept if already there) and prints its nats-server config file."""
    parser = argparse.ArgumentParser(prog="python -m shared.bus.nats_auth", allow_abbrev=False,
                                     description="Write one NATS user per service, with its subjects, into FOLDER "
                                                 "(nats-users.json and nats-auth.conf); an existing one is kept.")
    parser.add_argument("folder", help="where the users go (made if missing)")
    folder = Path(parser.parse_args(argv).folder)
    print(folder / CONF_FILE if (folder / USERS_FILE).exists() else write(folder))


if __name__ == "__main__":
    main()
