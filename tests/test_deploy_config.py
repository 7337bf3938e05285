"""The deploy workflow's config objects: ranges, what each field becomes in the engine, placement
and replica scaling decisions (no services: the stack tests are in tests/deploy/)."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest

from services.agent.replicas import Replica, Replicas
from shared.config import DEFAULTS, DEPLOYMENT_MAX_NUM_SEQS, ConfigError
from shared.control.agents import default_labels, fits, free_resources, host_accepts, needs
from shared.control.deploy_config import (
    Accel,
    ContinuousBatchingConfig,
    FrameworkConfig,
    QaicConfig,
    check_qaic_framework,
    parse_accel,
    parse_memory,
)
from shared.control.deployment import DeployedModel
from shared.control.registry import AgentRecord, ModelVersion, Pipeline, PipelineStep
from shared.wire.stats import SchedulerStats
from switchyard.config import Acceleration, DeploymentConfigBuilder
from tests.clock import ManualClock


def deployed(framework: FrameworkConfig | None = None, accel: str = "cpu", batch_config: str | None = None,
             cb: ContinuousBatchingConfig | None = None, builder: DeploymentConfigBuilder | None = None):
    version = ModelVersion(name="m", version=1, file_name="m.gguf", sha256="0" * 64, size=1, status="ready",
                           created_at=0.0, framework_config=framework or FrameworkConfig(), accel=Accel(kind=accel),
                           batch_config=batch_config, continuous_batching_config=cb)
    pipeline = Pipeline(name="p", id=7, created_at=0.0, steps=[PipelineStep("m", 1)], deployed=True, generation=1,
                        deployment_config=(builder or DeploymentConfigBuilder()).build())
    return DeployedModel(pipeline, version)


def test_every_framework_field_becomes_an_engine_setting():
    fc = FrameworkConfig(max_num_seqs=16, max_model_len=2048, block_size=32, kv_cache_dtype="bfloat16",
                         quantization="int8", gpu_memory_utilization=0.5, max_seq_len_to_capture=1024,
                         kv_offloading_size=2.0).validate("cpu")
    engine = deployed(fc, cb=ContinuousBatchingConfig(max_concurrent_batch_size=100)).engine_config()
    assert (engine.model, engine.max_num_seqs, engine.max_model_len, engine.block_size) == ("p-7", 16, 2048, 32)
    assert (engine.kv_cache_dtype, engine.quantization, engine.max_concurrent_batch_size) == ("bfloat16", "int8", 100)
    assert (engine.gpu_memory_utilization, engine.max_seq_len_to_capture, engine.kv_offloading_size) == (0.5, 1024, 2.0)
    with pytest.raises(ConfigError, match="framework_config.kv_offloading_size = -1 is out of range"):
        FrameworkConfig(kv_offloading_size=-1).validate("cpu")
    with pytest.raises(ConfigError, match="accel 'qaic' keeps whole sequences"):
        FrameworkConfig(kv_offloading_size=1).validate("qaic")


def test_the_continuous_batching_configs_speculative_config_reaches_the_engine_checked():
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4}
    engine = deployed(cb=ContinuousBatchingConfig(speculative_config=spec).validate()).engine_config()
    assert (engine.speculative_config.num_speculative_tokens, engine.speculative_config.prompt_lookup_min) == (3, 4)
    with pytest.raises(ConfigError, match="continuous_batching_config.speculative_config: method 'medusa' is not built"):
        ContinuousBatchingConfig(speculative_config={"method": "medusa", "num_speculative_tokens": 3}).validate()


def test_a_framework_config_left_empty_gives_the_engine_defaults_but_vllms_max_num_seqs():
    engine = deployed().engine_config()
    assert engine.max_num_seqs == DEPLOYMENT_MAX_NUM_SEQS == 256
    assert msgspec.structs.replace(engine, model=DEFAULTS.model, max_num_seqs=DEFAULTS.max_num_seqs) == DEFAULTS


def test_single_batch_mode_runs_one_request_at_a_time():
    engine = deployed(batch_config="single").engine_config()
    assert engine.max_num_seqs == 1 and engine.max_concurrent_batch_size == 1


def test_the_kv_pool_is_utilization_times_memory_less_the_weights():
    d = deployed(FrameworkConfig(gpu_memory_utilization=0.5),
                 builder=DeploymentConfigBuilder().sidekick_memory("m", "2Gi").sidekick_cpus("m", 3))
    assert d.kv_cache_bytes(weight_bytes=2**29) == 2**30 - 2**29
    assert d.worker_threads == 3
    with pytest.raises(ConfigError, match="raise sidekick_memory"):
        d.kv_cache_bytes(weight_bytes=2**30)


@pytest.mark.parametrize(("value", "size"), [("512Mi", 512 * 2**20), ("4Gi", 4 * 2**30), ("1G", 10**9),
                                              ("1.5Gi", int(1.5 * 2**30)), ("2097152", 2**21)])
def test_memory_quantities(value, size):
    assert parse_memory("memory", value) == size


@pytest.mark.parametrize("value", ["4 gigs", "-1Gi", "1Pi", "100"])
def test_bad_memory_quantities_are_refused_by_name(value):
    with pytest.raises(ConfigError, match=r"^memory = "):
        parse_memory("memory", value)


def test_quantization_and_kv_dtypes_no_backend_has_are_refused_clearly():
    with pytest.raises(ConfigError, match="kv_cache_dtype = 'fp8' is not supported by the torch backend"):
        FrameworkConfig(kv_cache_dtype="fp8").validate("cpu")
    with pytest.raises(ConfigError, match="'int8' runs on torch's CPU kernels only, not on 'cuda'"):
        FrameworkConfig(quantization="int8").validate("cuda")
    assert FrameworkConfig(quantization=None).validate("cuda")


def test_the_tutorials_qaic_formats_are_accepted_exactly_on_qaic():
    tutorial = FrameworkConfig(max_num_seqs=16, max_model_len=256, max_seq_len_to_capture=128, quantization="mxfp6",
                               kv_cache_dtype="mxint8", gpu_memory_utilization=1)
    qaic = QaicConfig(num_devices=4, full_batch_size=16, ctx_len=256, prefill_seq_len=128, mxfp6_matmul=True,
                      mxint8_kv_cache=True)
    check_qaic_framework(tutorial.validate("qaic"), qaic.validate())
    for accel in ("cpu", "cuda"):
        with pytest.raises(ConfigError, match=f"runs on accel 'qaic' only, not on '{accel}'"):
            FrameworkConfig(quantization="mxfp6").validate(accel)
        with pytest.raises(ConfigError, match=f"'mxint8' runs on accel 'qaic' only, not on '{accel}'"):
            FrameworkConfig(kv_cache_dtype="mxint8").validate(accel)
    with pytest.raises(ConfigError, match="quantization = 'int4' is not allowed on accel 'qaic'"):
        FrameworkConfig(quantization="int4").validate("qaic")
    with pytest.raises(ConfigError, match="'mxfp6' needs accel.qaic.mxfp6_matmul = True"):
        check_qaic_framework(tutorial, QaicConfig(ctx_len=256, mxint8_kv_cache=True))
    with pytest.raises(ConfigError, match="'mxint8' needs accel.qaic.mxint8_kv_cache = True"):
        check_qaic_framework(tutorial, QaicConfig(ctx_len=256, mxfp6_matmul=True))
    with pytest.raises(ConfigError, match="max_model_len = 256 is longer than accel.qaic.ctx_len = 128"):
        check_qaic_framework(tutorial, QaicConfig(ctx_len=128, prefill_seq_len=32, mxfp6_matmul=True,
                                                  mxint8_kv_cache=True))
    with pytest.raises(ConfigError, match="block_size = 16 is not allowed on accel 'qaic'"):
        check_qaic_framework(FrameworkConfig(block_size=16), qaic)
    assert parse_accel("qaic").qaic == QaicConfig()  # a bare "qaic" takes the defaults


def test_accelerators_on_the_wire():
    assert parse_accel("cpu").kind == "cpu"
    qaic = Acceleration.QAIC.with_config(QaicConfig(num_cores=4, full_batch_size=8, mxfp6_matmul=True))
    parsed = parse_accel(qaic.to_wire())
    assert (parsed.kind, parsed.qaic.num_cores, parsed.qaic.full_batch_size, parsed.qaic.mxfp6_matmul) == \
        ("qaic", 4, 8, True)
    with pytest.raises(ValueError):
        Acceleration.CPU.with_config(QaicConfig())
    with pytest.raises(ConfigError, match=r"accel.qaic.full_batch_size = 0 is out of range: allowed 1 to 1024"):
        QaicConfig(full_batch_size=0).validate()


def test_placement_by_accel_device_group_and_budget():
    host = AgentRecord(agent_id="h", accel="cpu", device_group="rack-a", cpus=4, memory=8 * 2**30)
    assert host_accepts(host, deployed(FrameworkConfig(device_group="rack-a"))) is None
    assert "device group" in host_accepts(host, deployed(FrameworkConfig(device_group="rack-b")))
    assert "offers accel 'cpu'" in host_accepts(host, deployed(accel="qaic"))
    d = deployed(builder=DeploymentConfigBuilder().sidekick_cpus("m", 2).sidekick_memory("m", "3Gi"))
    assert needs(d, 2) == (4, 6 * 2**30, 0)
    engine = deployed(builder=DeploymentConfigBuilder().cpus(1).memory("1Gi")).engine_resources()
    assert engine == (1, 2**30, 0)
    scheduler = AgentRecord(agent_id="s", accel="engine", device_group=None, cpus=2, memory=4 * 2**30)
    assert fits(free_resources(scheduler, [engine]), engine) is None
    assert "needs 1 CPUs, 0 free" in fits(free_resources(scheduler, [engine, engine]), engine)
    assert fits(free_resources(host, [needs(d, 1)]), needs(d, 1)) is None
    assert "needs 2 CPUs, 0 free" in fits(free_resources(host, [needs(d, 2)]), needs(d, 1))


def test_a_deployment_label_runs_only_on_hosts_that_carry_it():
    host = AgentRecord(agent_id="h", accel="cpu", device_group=None, cpus=8, memory=8 * 2**30,
                       labels=default_labels("h") + ["rack:a"])
    assert "kubernetes.io/os:linux" in host.labels and "kubernetes.io/hostname:h" in host.labels
    on = lambda label: deployed(builder=DeploymentConfigBuilder().deployment_label(label))  # noqa: E731
    assert host_accepts(host, on("kubernetes.io/os:linux")) is None  # the product's tutorial's label
    assert host_accepts(host, on("rack:a")) is None
    assert host_accepts(host, on("rack:b")) == "host h has no label 'rack:b' (deployment_config.deployment_label)"
    with pytest.raises(ConfigError, match="deployment_label = 'no colon' is not a label: use key:value"):
        DeploymentConfigBuilder().deployment_label("no colon").build().validate()


def test_qaic_replicas_reserve_socs_on_hosts_that_offer_qaic():
    host = AgentRecord(agent_id="h", accel="cpu", offers=["cpu", "qaic"], device_group=None, cpus=8,
                       memory=32 * 2**30, qaic_socs=8, qaic_emulated=True)
    q = deployed(accel="qaic", builder=DeploymentConfigBuilder().sidekick_gpus("m", 4))
    q.version.accel = parse_accel({"qaic": {"num_devices": 2}})
    assert host_accepts(host, q) is None and host_accepts(host, deployed()) is None
    assert needs(q, 1)[2] == 4  # sidekick_gpus SoCs
    assert fits(free_resources(host, [needs(q, 1)]), needs(q, 1)) is None
    assert "needs 4 QAIC SoCs (sidekick_gpus), 0 free" in fits(free_resources(host, [needs(q, 2)]), needs(q, 1))
    bare = deployed(accel="qaic")
    bare.version.accel = parse_accel({"qaic": {"num_devices": 2}})
    assert needs(bare, 1)[2] == 2  # no sidekick_gpus: the program's devices
    one = deployed(accel="qaic", builder=DeploymentConfigBuilder().sidekick_gpus("m", 1))
    one.version.accel = parse_accel({"qaic": {"num_devices": 2}})
    assert "sidekick_gpus = 1 SoCs cannot hold a program compiled for accel.qaic.num_devices = 2" in \
        host_accepts(host, one)


class _Running:
    pid = 1

    def poll(self):
        return None


def test_replicas_follow_the_queue_within_their_bounds():
    d = deployed(builder=DeploymentConfigBuilder().replicas(1, 2))
    clock = ManualClock()
    replicas = Replicas(d, "nats://unused", Path("/nonexistent"), [], scale_up_after_s=5.0, scale_down_after_s=30.0,
                        clock=clock)
    add = lambda: replicas.replicas.append(Replica("w", _Running(), Path("/nonexistent"), state="running"))  # noqa: E731
    stats = lambda running, waiting: SchedulerStats(  # noqa: E731
        model="p-7", num_workers=1, num_running=running, num_waiting=waiting, kv_cache_usage=0.0)
    add()
    assert replicas.wanted(stats(1, 3)) == 1  # the queue has only just become deep
    clock.advance(5.0)
    assert replicas.wanted(stats(1, 3)) == 1  # deep for scale_up_after_s, not longer
    clock.advance(0.1)
    assert replicas.wanted(stats(1, 3)) == 2  # it stayed deep: one more
    add()
    replicas.wanted(stats(2, 3))
    clock.advance(6.0)
    assert replicas.wanted(stats(2, 3)) == 2  # never past replicas_max
    assert replicas.wanted(stats(0, 0)) == 2  # only just idle
    clock.advance(29.0)
    assert replicas.wanted(stats(0, 1)) == 2  # a request came: the idle time starts again
    replicas.wanted(stats(0, 0))
    clock.advance(29.0)
    assert replicas.wanted(stats(0, 0)) == 2
    clock.advance(2.0)
    assert replicas.wanted(stats(0, 0)) == 1  # it stayed idle: one fewer
    replicas.replicas.pop()
    replicas.wanted(stats(0, 0))
    clock.advance(31.0)
    assert replicas.wanted(stats(0, 0)) == 1  # never under replicas_min


class _Signalled(_Running):
    def __init__(self):
        self.signals = []

    def send_signal(self, signum):
        self.signals.append(signum)


def test_stopping_replicas_are_signalled_once_so_their_drain_is_not_cut_short():
    replicas = Replicas(deployed(), "nats://unused", Path("/nonexistent"), [])
    proc = _Signalled()
    replicas.replicas.append(Replica("w", proc, Path("/nonexistent"), state="running"))
    replicas.stop_all()
    replicas.stop_all()  # the agent's next tick, while the worker still drains
    assert len(proc.signals) == 1 and replicas.replicas[0].state == "stopping"
