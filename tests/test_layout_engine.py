"""Where the layout model runs: engine, device, threads and workers from what is installed,
the GPU, its memory plan and the cores (`layout_engine.choose`, `placement.layout_choice`)."""

from __future__ import annotations

import pytest

from ocrvl_daemon.config.model import Config
from ocrvl_daemon.engine.worker_settings import worker_setup
from ocrvl_daemon.errors import DependencyError
from ocrvl_daemon.server import autotune, gpu_memory, layout_engine, placement
from ocrvl_daemon.server.gpu import GpuReading
from ocrvl_daemon.server.layout_engine import Installed, LayoutChoice, choose, cpu_layout_plan
from ocrvl_daemon.server.placement import Placement
from ocrvl_daemon.worker.pipeline import limit_torch_threads

MODEL = "PP-DocLayoutV3"
PADDLE_CPU = Installed(frozenset({"paddle"}), frozenset())
TORCH_CUDA = Installed(frozenset({"paddle", "transformers"}), frozenset({"transformers"}))
EVERYTHING = Installed(frozenset(layout_engine.ENGINES), frozenset(layout_engine.ENGINES))


@pytest.fixture(autouse=True)
def two_cores(monkeypatch: pytest.MonkeyPatch) -> None:
    """The cores `autotune` counts when it plans a layout's workers: 2, whatever this machine
    has."""
    monkeypatch.setattr(layout_engine, "cpu_count", lambda: 2)


def card(total: int = 8188, used: int = 1024) -> GpuReading:
    return GpuReading(0, "GPU-test", "Test GPU", total, used, total - used, "560.94", (8, 9),
                      "nvidia-smi")


def pick(installed: Installed, gpu: GpuReading | None = None, *, room: int = 8,
         cores: int = 2, workers: int | None = None, engine: str = "auto",
         device: str = "auto") -> LayoutChoice:
    """The choice with `gpu` visible, which has room for `room` workers' layout models."""
    return choose(model=MODEL, engine=engine, device=device, installed=installed, gpu=gpu,
                  gpu_room=lambda _, workers: workers <= room, cores=cores, workers=workers)


@pytest.mark.quick
def test_no_gpu_runs_paddle_static_on_every_core_of_a_small_machine() -> None:
    choice = pick(PADDLE_CPU)
    assert (choice.engine, choice.device, choice.threads, choice.workers) == \
        ("paddle", "cpu", 2, 1)
    assert choice.describe() == "PP-DocLayoutV3 on cpu (paddle_static, 2 threads)"
    assert choice.why == "auto: no GPU here"
    assert choice.common_args() == {"engine": "paddle_static", "device": "cpu",
                                    "cpu_threads": 2}


@pytest.mark.quick
@pytest.mark.parametrize(("cores", "workers", "threads"), [
    (1, 1, 1), (2, 1, 2), (4, 1, 3), (8, 3, 2), (16, 6, 2), (32, 8, 3), (64, 8, 6)])
def test_layout_on_the_cpu_adds_workers_with_the_cores(cores: int, workers: int,
                                                        threads: int) -> None:
    assert cpu_layout_plan(cores, None) == (workers, threads)
    choice = pick(PADDLE_CPU, cores=cores)
    assert (choice.workers, choice.threads) == (workers, threads)


@pytest.mark.quick
def test_a_set_number_of_workers_shares_the_layout_cores() -> None:
    assert cpu_layout_plan(16, 3) == (3, 4)
    assert cpu_layout_plan(2, 1) == (1, 2)
    assert cpu_layout_plan(2, 4) == (4, 1)


@pytest.mark.quick
def test_gpu_with_room_and_a_cuda_engine_takes_the_layout_model() -> None:
    choice = pick(TORCH_CUDA, card(), cores=16)
    assert (choice.engine, choice.device, choice.threads) == ("transformers", "gpu:0", None)
    assert choice.workers == 4  # not running layout on the CPU: the layout-off rule
    assert choice.describe() == "PP-DocLayoutV3 on gpu:0 (transformers)"
    assert choice.common_args() == {"engine": "transformers", "device": "gpu:0"}


@pytest.mark.quick
def test_auto_workers_on_the_gpu_are_as_many_as_its_memory_holds() -> None:
    assert pick(TORCH_CUDA, card(), cores=16, room=2).workers == 2
    assert pick(TORCH_CUDA, card(), cores=16, room=1).workers == 1
    # A number of workers is kept: the plan keeps room for each.
    assert pick(TORCH_CUDA, card(), cores=16, room=1, workers=3).workers == 3


@pytest.mark.quick
def test_paddles_gpu_build_comes_first_on_the_gpu() -> None:
    assert pick(EVERYTHING, card()).engine == "paddle"
    assert pick(EVERYTHING, card(), engine="onnxruntime").engine == "onnxruntime"


@pytest.mark.quick
def test_a_gpu_without_room_leaves_the_layout_model_on_the_cpu() -> None:
    choice = pick(TORCH_CUDA, card(), room=0)
    assert (choice.engine, choice.device, choice.threads) == ("transformers", "cpu", 2)
    assert "no room" in choice.why


@pytest.mark.quick
def test_a_gpu_without_a_cuda_engine_leaves_the_layout_model_on_the_cpu() -> None:
    choice = pick(PADDLE_CPU, card())
    assert choice.device == "cpu"
    assert "no engine that can use the GPU" in choice.why


@pytest.mark.quick
def test_layout_device_cpu_wins_over_a_free_gpu() -> None:
    assert pick(TORCH_CUDA, card(), device="cpu").device == "cpu"


@pytest.mark.quick
def test_on_the_cpu_torch_comes_first_then_paddle_then_onnxruntime() -> None:
    everything = pick(Installed(frozenset({"paddle", "onnxruntime", "transformers"}), frozenset()))
    assert (everything.engine, everything.threads) == ("transformers", 2)
    assert everything.model_folder == "PP-DocLayoutV3_safetensors"
    # PaddleX's transformers engine takes no thread count: the worker holds torch to it.
    assert everything.common_args() == {"engine": "transformers", "device": "cpu"}
    assert pick(Installed(frozenset({"paddle", "onnxruntime"}), frozenset())).engine == "paddle"
    onnx = pick(Installed(frozenset({"onnxruntime"}), frozenset()))
    assert onnx.common_args()["engine_config"] == {"intra_op_num_threads": 2}
    assert onnx.model_folder == "PP-DocLayoutV3_onnx"


@pytest.mark.quick
@pytest.mark.parametrize(("kwargs", "says"), [
    ({"device": "gpu"}, "pipeline.layout_device = 'gpu': no such GPU"),
    ({"device": "gpu", "gpu": card()}, "'gpu:0': an engine that can use the GPU is not"),
    ({"engine": "onnxruntime"}, "pipeline.layout_engine = 'onnxruntime'"),
])
def test_a_choice_that_cannot_run_here_names_the_key_and_the_fix(kwargs: dict,
                                                                  says: str) -> None:
    gpu = kwargs.pop("gpu", None)
    with pytest.raises(DependencyError) as raised:
        pick(PADDLE_CPU, gpu, **kwargs)
    assert says in raised.value.message
    assert raised.value.fix


@pytest.mark.quick
@pytest.mark.parametrize(("value", "parsed"), [
    ("auto", ("auto", None)), ("CPU", ("cpu", None)), ("gpu", ("gpu", None)),
    ("gpu:1", ("gpu", 1))])
def test_parse_device(value: str, parsed: tuple[str, int | None]) -> None:
    assert layout_engine.parse_device(value) == parsed


@pytest.mark.quick
@pytest.mark.parametrize(("dists", "torch_cuda", "cpu", "gpu"), [
    ({"paddlepaddle"}, False, {"paddle"}, set()),
    ({"paddlepaddle-gpu"}, False, {"paddle"}, {"paddle"}),
    ({"onnxruntime-gpu"}, False, {"onnxruntime"}, {"onnxruntime"}),
    ({"transformers", "torch", "torchvision"}, True, {"transformers"}, {"transformers"}),
    ({"transformers", "torch", "torchvision"}, False, {"transformers"}, set()),
    ({"transformers", "torch"}, True, set(), set()),  # the detector needs torchvision
    # A transformers before PP-DocLayoutV2/V3 (e.g. one a server environment brought).
    ({"transformers-5.5.3", "torch", "torchvision"}, True, set(), set()),
])
def test_installed_engines_from_package_metadata(dists: set[str], torch_cuda: bool,
                                                 cpu: set[str], gpu: set[str]) -> None:
    def version(name: str) -> str | None:
        if name == "transformers":
            return "5.5.3" if "transformers-5.5.3" in dists else \
                "5.14.0" if name in dists else None
        return "1.0" if name in dists else None

    found = layout_engine.installed_engines(version, lambda: torch_cuda)
    assert (found.cpu, found.gpu) == (cpu, gpu)


# --- the VRAM plan: autotune ----------------------------------------------------------------

@pytest.mark.quick
def test_an_8_gb_card_keeps_the_layout_models_room_and_the_server_still_fits() -> None:
    config = Config.model_validate({})
    rtx4060 = card()
    alone = autotune.plan_vllm_args(config, rtx4060, installed=PADDLE_CPU)
    shared = autotune.plan_vllm_args(config, rtx4060, installed=TORCH_CUDA)
    assert alone.values[autotune.UTILIZATION] == 0.64
    room = (alone.values[autotune.UTILIZATION] - shared.values[autotune.UTILIZATION]) * 8188
    assert layout_engine.LAYOUT_GPU_MIB <= room < layout_engine.LAYOUT_GPU_MIB + 0.02 * 8188
    assert not shared.warnings
    assert any("for the layout model" in r for r in shared.reasons)
    assert gpu_memory.layout_fits(config, rtx4060)
    choice = placement.layout_choice(config, [rtx4060], TORCH_CUDA, cores=2)
    assert choice.device == "gpu:0"


@pytest.mark.quick
def test_each_worker_with_the_layout_model_on_the_gpu_gets_its_room(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(layout_engine, "cpu_count", lambda: 16)  # auto: up to 4 workers
    config = Config.model_validate({})
    rtx3060 = card(total=12282)
    choice = placement.layout_choice(config, [rtx3060], TORCH_CUDA)
    assert choice.device == "gpu:0" and choice.workers == 2  # 3 would leave vLLM too little
    assert placement.layout_choice(config, [card()], TORCH_CUDA).workers == 1  # 8 GB
    plan = autotune.plan_vllm_args(config, rtx3060, installed=TORCH_CUDA)
    assert f"{2 * layout_engine.LAYOUT_GPU_MIB / 1024:.1f} GiB for the layout model" in \
        " ".join(plan.reasons)
    assert not plan.warnings


@pytest.mark.quick
def test_a_card_too_small_for_both_keeps_the_layout_model_on_the_cpu() -> None:
    config = Config.model_validate({})
    small = card(total=4096, used=1024)
    assert not gpu_memory.layout_fits(config, small)
    assert placement.layout_choice(config, [small], TORCH_CUDA, cores=2).device == "cpu"
    plan = autotune.plan_vllm_args(config, small, installed=TORCH_CUDA)
    assert not any("layout" in r for r in plan.reasons)


@pytest.mark.quick
def test_beside_a_managed_server_the_answer_does_not_change_once_the_server_holds_memory(
) -> None:
    # The workers choose while ocrvl's own server (and other workers) hold the card; the
    # server planned its room before: both must reach the same answer.
    config = Config.model_validate({})
    assert gpu_memory.layout_fits(config, card(used=1024))
    assert gpu_memory.layout_fits(config, card(used=7000))
    assert placement.layout_choice(config, [card(used=7000)], TORCH_CUDA).device == "gpu:0"


@pytest.mark.quick
def test_a_server_squeezed_by_other_programs_and_the_layout_model_is_warned_about() -> None:
    busy = card(used=3072)  # e.g. another program beside the desktop
    plan = autotune.plan_vllm_args(Config.model_validate({}), busy, installed=TORCH_CUDA)
    assert any("may run out of memory" in w and "layout_device: cpu" in w
               for w in plan.warnings), plan.warnings


@pytest.mark.quick
def test_an_explicit_utilization_must_leave_the_room_free() -> None:
    tight = Config.model_validate({"server": {"vllm_args": {"gpu-memory-utilization": 0.85}}})
    loose = Config.model_validate({"server": {"vllm_args": {"gpu-memory-utilization": 0.4}}})
    assert not gpu_memory.layout_fits(tight, card())
    assert gpu_memory.layout_fits(loose, card())


@pytest.mark.quick
def test_beside_an_external_server_the_room_must_be_free_now() -> None:
    config = Config.model_validate({"server": {"mode": "external",
                                               "url": "http://gpu-box:8118/v1"}})
    assert gpu_memory.layout_fits(config, card(used=1024))
    assert not gpu_memory.layout_fits(config, card(used=7500))


@pytest.mark.quick
def test_layout_device_gpu_keeps_the_room_even_where_auto_would_not() -> None:
    config = Config.model_validate({"pipeline": {"layout_device": "gpu"}})
    small = card(total=4096, used=1024)
    assert placement.layout_room_mib(config, small, TORCH_CUDA) == layout_engine.LAYOUT_GPU_MIB
    assert placement.layout_room_mib(Config.model_validate({}), small, TORCH_CUDA) == 0
    # An engine that cannot use the GPU: the worker reports it, nothing is kept.
    assert placement.layout_room_mib(config, small, PADDLE_CPU) == 0
    off = Config.model_validate({"pipeline": {"use_layout_detection": False}})
    assert placement.layout_room_mib(off, card(), TORCH_CUDA) == 0


def test_model_folders_are_paddlexs_download_names() -> None:
    from paddlex.inference.utils.official_models import _format_download_model_name

    formats = {"paddle": "paddle", "onnxruntime": "onnx", "transformers": "safetensors"}
    for model in ("PP-DocLayoutV2", "PP-DocLayoutV3"):
        for engine, fmt in formats.items():
            choice = LayoutChoice(model, engine, "cpu", None, 1, "test")
            assert choice.model_folder == _format_download_model_name(model, fmt)


def test_a_torch_worker_on_the_cpu_keeps_to_its_threads() -> None:
    torch = pytest.importorskip("torch")
    choice = pick(Installed(frozenset({"transformers"}), frozenset()), cores=8, workers=3)
    config = Config.model_validate({"pipeline": {"workers": 3}})
    setup = worker_setup(config, Placement(3, choice))
    limit_torch_threads(setup.torch_threads)  # as the worker and its layout process do
    assert torch.get_num_threads() == choice.threads == 2, (
        "each CPU layout worker must hold torch to its share of the cores, or the workers' "
        "threads fight over them")
