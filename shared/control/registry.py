"""The model registry and the desired state of deployments, kept in NATS JetStream.

- Object Store `sy-artifacts`: model files, one object per version (`<model>/<version>/<file>`).
- KV `sy-registry`: `models.<name>.<version>` (a ModelVersion) and `pipelines.<name>` (a Pipeline,
  whose `deployed` flag and `generation` are the desired state that schedulers, API gateways and
  worker agents watch).
- KV `sy-agents` (entries expire): which worker hosts are alive, what they offer, what they run.

Values are JSON (msgspec), so `nats kv get sy-registry models.smollm2.1` is readable.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import msgspec
from nats.aio.client import Client
from nats.js.api import StorageType
from nats.js.errors import BucketNotFoundError, KeyNotFoundError, KeyWrongLastSequenceError

from shared.bus import replicas
from shared.control.deploy_config import (
    NAME_RE,
    Accel,
    ContinuousBatchingConfig,
    DeploymentConfig,
    FrameworkConfig,
    OpenaiConfig,
)
from shared.log import get_logger
from shared.models.model_files import artifact_root, cache_root, model_in, unpacked

ARTIFACTS_BUCKET = "sy-artifacts"
REGISTRY_BUCKET = "sy-registry"
AGENTS_BUCKET = "sy-agents"
AGENT_TTL_S = 10.0  # an agent refreshes its entry every few seconds; a dead one disappears


class PipelineStep(msgspec.Struct):
    model: str
    version: int


class ModelVersion(msgspec.Struct, kw_only=True):
    name: str
    version: int
    file_name: str
    sha256: str
    size: int
    status: str  # "ready" once the artifact is stored and inspected; "error" with `error`
    created_at: float
    framework: str = "vllm"
    framework_config: FrameworkConfig = msgspec.field(default_factory=FrameworkConfig)
    accel: Accel = msgspec.field(default_factory=Accel)
    continuous_batching_config: ContinuousBatchingConfig | None = None
    openai_config: OpenaiConfig | None = None
    batch_config: str | None = None  # "single": one request at a time (no continuous batching)
    visibility: str = "private"
    workspace_id: int | None = None
    python_version: str | None = None  # recorded; the model runs in the server's own environment
    input_schema: str | None = None  # base64 Arrow schemas (shared/control/arrow_schema.py): the records route's
    output_schema: str | None = None
    architecture: str = ""  # read from the artifact at upload
    context_length: int = 0
    error: str | None = None
    lora_base: PipelineStep | None = None  # a LoRA adapter (PEFT's files): the model version it adapts
    lora_rank: int = 0

    @property
    def object_name(self) -> str:
        return f"{self.name}/{self.version}/{self.file_name}"


class Publish(msgspec.Struct, kw_only=True):
    """A pipeline pushed to an OCI registry (pipeline.publish()), as the product lists them."""
    id: int
    pipeline_name: str
    pipeline_version: int  # the pipeline's generation when it was published
    status: str  # "Published" or "Error"
    created_at: float
    updated_at: float
    pipeline_url: str = ""  # the reference pushed, host/repository:tag (`switchyard serve --from` it)
    digest: str = ""  # the manifest's digest: exactly this artifact
    engine_version: str = ""
    deployment_config: DeploymentConfig | None = None
    error: str | None = None


class Pipeline(msgspec.Struct, kw_only=True):
    name: str
    id: int
    created_at: float
    steps: list[PipelineStep] = []
    deployed: bool = False
    generation: int = 0  # bumped by every deploy: a changed generation means "restart with the new state"
    deployment_config: DeploymentConfig | None = None
    publishes: list[Publish] = []
    # a pipeline of several model steps (RAG: an embedder, then the LLM) deploys each step as a
    # pipeline of its own, named here; those name their parent
    children: list[str] = []
    parent: str | None = None
    loras: list[PipelineStep] = []  # LoRA adapters of its model step, served beside it by its name

    @property
    def serves(self) -> bool:
        """Deployed and served as one model: what schedulers, agents and gateways run (a pipeline of
        several steps is deployed, and its children serve)."""
        return self.deployed and not self.children

    @property
    def deployment(self) -> str:
        """The deployment's name: the bus subject token and the `{deployment}` of inference URLs."""
        return f"{self.name}-{self.id}"


class WorkerState(msgspec.Struct, kw_only=True):
    worker_id: str
    deployment: str
    generation: int
    pid: int
    state: str  # starting | running | stopping | failed
    error: str | None = None


class AgentRecord(msgspec.Struct, kw_only=True):
    agent_id: str
    accel: str  # the host's first accelerator ("engine": the scheduler process's budget record)
    device_group: str | None
    cpus: float
    memory: int
    offers: list[str] = []  # every accelerator the host runs workers on, e.g. ["cpu", "qaic"]; [] = [accel]
    qaic_socs: int = 0  # Cloud AI 100 SoCs the host's QAIC replicas may take (sidekick_gpus each)
    qaic_emulated: bool = False  # no cards: the SoCs are the emulator's
    labels: list[str] = []  # "key:value" node labels a deployment_label is matched against
    ip: str = ""  # the host's address, as pipelines/status shows it
    workers: list[WorkerState] = []
    refused: dict[str, str] = {}  # pipeline -> why this host does not run it
    updated_at: float = 0.0


_json = msgspec.json.Encoder()
log = get_logger("registry")


class Registry:
    def __init__(self, nc: Client):
        self.js = nc.jetstream()
        self.kv = None
        self.agents = None
        self.objects = None

    async def open(self) -> Registry:
        self.kv = await self._bucket(REGISTRY_BUCKET)
        self.agents = await self._bucket(AGENTS_BUCKET, ttl=AGENT_TTL_S)
        try:
            self.objects = await self.js.object_store(ARTIFACTS_BUCKET)
        except BucketNotFoundError:
            self.objects = await self.js.create_object_store(ARTIFACTS_BUCKET, storage=StorageType.FILE,
                                                             replicas=replicas())
        return self

    async def _bucket(self, name: str, ttl: float | None = None):
        try:
            return await self.js.key_value(name)
        except BucketNotFoundError:
            return await self.js.create_key_value(bucket=name, history=1, ttl=ttl, storage=StorageType.FILE,
                                                  replicas=replicas())

    # ---- values --------------------------------------------------------------------------------

    async def _keys(self, bucket: str, prefix: str) -> list[str]:
        """The keys under a prefix, each once, from one snapshot of the bucket's stream.

        Not nats-py's KeyValue.keys(): it lists through a consumer, so a key updated while it lists
        comes back twice, and an early "no more" marker can make it return nothing at all (both
        seen against nats-server 2.9; tests/test_registry.py). A deleted key is still listed here
        (its delete marker is a message); reading it gives KeyNotFoundError.
        """
        root = f"$KV.{bucket}."
        info = await self.js.stream_info(f"KV_{bucket}", subjects_filter=f"{root}{prefix}>")
        return sorted(subject[len(root):] for subject in info.state.subjects or {})

    async def _get(self, key: str, cls):
        try:
            entry = await self.kv.get(key)
        except KeyNotFoundError:
            return None
        try:
            return msgspec.json.decode(entry.value, type=cls) if entry.value else None
        except msgspec.DecodeError as exc:  # one bad record never breaks a listing, nor a lookup
            log.error("registry_record_unreadable", key=key, error=str(exc))
            return None

    async def _values(self, prefix: str, cls) -> list:
        values = [await self._get(k, cls) for k in await self._keys(REGISTRY_BUCKET, prefix)]
        return [v for v in values if v is not None]

    # ---- models --------------------------------------------------------------------------------

    async def versions(self, name: str) -> list[ModelVersion]:
        if not _is_name(name):
            return []
        return sorted(await self._values(f"models.{name}.", ModelVersion), key=lambda v: v.version)

    async def models(self) -> list[ModelVersion]:
        """The latest version of every model."""
        latest: dict[str, ModelVersion] = {}
        for v in await self._values("models.", ModelVersion):
            if v.name not in latest or v.version > latest[v.name].version:
                latest[v.name] = v
        return sorted(latest.values(), key=lambda v: v.name)

    async def version(self, name: str, version: int | None = None) -> ModelVersion | None:
        if version is None:
            versions = await self.versions(name)
            return versions[-1] if versions else None
        if not _is_name(name) or not isinstance(version, int) or isinstance(version, bool):
            return None
        return await self._get(f"models.{name}.{version}", ModelVersion)

    async def create_version(self, record: ModelVersion) -> ModelVersion:
        """Store under the next free version number (atomic: two uploads never share one)."""
        while True:
            record.version = max((v.version for v in await self.versions(record.name)), default=0) + 1
            try:
                await self.kv.create(f"models.{record.name}.{record.version}", _json.encode(record))
                return record
            except KeyWrongLastSequenceError:
                continue

    async def put_version(self, record: ModelVersion) -> None:
        await self.kv.put(f"models.{record.name}.{record.version}", _json.encode(record))

    # ---- artifacts -----------------------------------------------------------------------------

    async def put_artifact(self, object_name: str, reader) -> tuple[str, int]:
        """Stream a file-like object into the Object Store in chunks; returns (sha256 hex, size)."""
        hashing = _HashingReader(reader)
        await self.objects.put(object_name, hashing)
        return hashing.sha256.hexdigest(), hashing.size

    async def model_path(self, record: ModelVersion) -> str:
        """The version as a loadable path: its artifact fetched into the cache, a zip extracted."""
        path = await self.fetch_artifact(record, cache_root())
        loadable = await asyncio.to_thread(unpacked, str(path))
        return model_in(artifact_root(path)) if record.framework == "custom" else loadable

    async def fetch_artifact(self, record: ModelVersion, cache_root: Path) -> Path:
        """The artifact as a local file (cached by sha256, checked after download)."""
        folder = cache_root / "artifacts" / record.sha256
        path = folder / record.file_name
        if path.exists():
            return path
        folder.mkdir(parents=True, exist_ok=True)
        partial = folder / f".{record.file_name}.{os.getpid()}.partial"
        with open(partial, "wb") as out:
            await self.objects.get(record.object_name, writeinto=out)
        digest = await asyncio.to_thread(_sha256_file, partial)
        if digest != record.sha256:
            partial.unlink()
            raise ValueError(f"artifact {record.object_name}: sha256 {digest} != recorded {record.sha256}")
        partial.rename(path)
        return path

    # ---- pipelines -----------------------------------------------------------------------------

    async def pipeline(self, name: str) -> Pipeline | None:
        if not _is_name(name):
            return None
        return await self._get(f"pipelines.{name}", Pipeline)

    async def pipelines(self) -> list[Pipeline]:
        return sorted(await self._values("pipelines.", Pipeline), key=lambda p: p.id)

    async def put_pipeline(self, pipeline: Pipeline) -> None:
        await self.kv.put(f"pipelines.{pipeline.name}", _json.encode(pipeline))

    async def create_pipeline(self, name: str) -> Pipeline:
        """The pipeline by that name, created with the next id if it does not exist yet."""
        while (existing := await self.pipeline(name)) is None:
            next_id = max((p.id for p in await self.pipelines()), default=0) + 1
            try:
                await self.kv.create(f"pipelines.{name}", _json.encode(Pipeline(name=name, id=next_id,
                                                                                 created_at=time.time())))
            except KeyWrongLastSequenceError:
                continue
        return existing

    async def watch_pipelines(self) -> AsyncIterator[tuple[str, Pipeline | None]]:
        """(name, pipeline) now for each one stored, then on every change; None when deleted."""
        watcher = await self.kv.watch("pipelines.*")
        try:
            async for entry in watcher:
                if entry is None:
                    continue  # "no more history": what follows are live changes
                name = entry.key.split(".", 1)[1]
                yield name, (msgspec.json.decode(entry.value, type=Pipeline) if entry.value else None)
        finally:
            with contextlib.suppress(Exception):  # the connection may be closing already
                await watcher.stop()

    async def follow_pipelines(self, apply: Callable[[str, Pipeline | None], Awaitable[None]]) -> None:
        """apply(name, pipeline) for every pipeline now and on every change, until cancelled. A watch
        that fails (the bus went away) starts again, replaying the current state: `apply` must
        take a state it has seen before."""
        while True:
            try:
                async for name, pipeline in self.watch_pipelines():
                    await apply(name, pipeline)
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("deployment_watch_failed")
                await asyncio.sleep(1.0)

    # ---- agents --------------------------------------------------------------------------------

    async def put_agent(self, record: AgentRecord) -> None:
        record.updated_at = time.time()
        await self.agents.put(f"agents.{record.agent_id}", _json.encode(record))

    async def agent_records(self) -> list[AgentRecord]:
        records = []
        for key in await self._keys(AGENTS_BUCKET, "agents."):
            try:
                entry = await self.agents.get(key)
            except KeyNotFoundError:
                continue
            if entry.value:
                records.append(msgspec.json.decode(entry.value, type=AgentRecord))
        return records


class _HashingReader:
    """A reader the Object Store pulls chunks from, hashing and counting what passes."""

    def __init__(self, raw):
        self.raw = raw
        self.sha256 = hashlib.sha256()
        self.size = 0

    def readinto(self, buffer) -> int:
        data = self.raw.read(len(buffer))
        n = len(data)
        buffer[:n] = data
        self.sha256.update(data)
        self.size += n
        return n


def _is_name(name: object) -> bool:
    """A registry name is one key token: never a wildcard, a separator or a control character."""
    return isinstance(name, str) and NAME_RE.fullmatch(name) is not None


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()
