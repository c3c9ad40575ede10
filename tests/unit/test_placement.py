"""The demo's placement: trainer and rollout on GPUs (a GPU each, or sharing one with shares that add up, the trainer
reserved first), an error naming the stages and their memory when they do not fit, threads split over the cores.
Pure arithmetic: the GPUs are described, none is used (this machine has none)."""
from __future__ import annotations

import pytest

from rlstream.demo import DemoSettings, demo_placement, seat_flags
from rlstream.errors import UserError
from rlstream.infra.placement import (HEADROOM, Gpu, Need, PlacementError, Seat, assign, parse_smi, place,
                                      split_threads)
from rlstream.infra.supervisor import seat_env
from rlstream.models.resources import GIB, ModelShape, engine_bytes, trainer_bytes

#: SmolLM2-135M's shape (config.json of the GGUF conversion in issue 26).
SMOL = ModelShape(params=134_515_008, hidden=576, layers=30, vocab=49152)


def needs(trainer_share=0.0, rollout_share=0.0, trainer=10 * GIB, rollout=6 * GIB):
    return [Need("trainer", trainer, trainer_share), Need("rollout", rollout, rollout_share)]


def test_no_gpu_puts_every_stage_on_the_cpu_with_the_cores_divided():
    seats = place(needs(), [], cores=2, light=4)
    assert seats == {"trainer": Seat("trainer", None, 0.0, 1), "rollout": Seat("rollout", None, 0.0, 1)}
    assert seats["trainer"].device == "cpu"
    many = place(needs(), [], cores=16, light=4)
    # The four light stages share a core per four; the trainer and the rollout divide the other twelve.
    assert (many["trainer"].threads, many["rollout"].threads) == (6, 6)
    assert split_threads(5, {"trainer": False, "rollout": False}, light=4) == {"trainer": 2, "rollout": 2}
    assert split_threads(4, {"trainer": False, "rollout": False}, light=4) == {"trainer": 2, "rollout": 1}


def test_two_gpus_give_each_stage_its_own():
    gpus = [Gpu(0, 80 * GIB, 79 * GIB), Gpu(1, 80 * GIB, 79 * GIB)]
    seats = place(needs(), gpus, cores=16, light=4)
    assert (seats["trainer"].gpu, seats["rollout"].gpu) == (0, 1)
    # Alone on a GPU a stage takes what is free there less its headroom.
    assert seats["trainer"].share == pytest.approx((79 - 1) / 80, abs=0.01)
    assert seats["trainer"].share <= (79 * GIB - HEADROOM) / (80 * GIB)
    # On a GPU a stage launches kernels: 2 CPU threads each.
    assert (seats["trainer"].threads, seats["rollout"].threads) == (2, 2)
    assert assign(3, 2) == [0, 1, 1] and assign(3, 3) == [0, 1, 2] and assign(2, 1) == [0, 0]


def test_one_gpu_is_shared_with_shares_that_add_up_and_the_trainer_reserved_first():
    gpu = Gpu(0, 24 * GIB, 23 * GIB)
    seats = place(needs(trainer=10 * GIB, rollout=6 * GIB), [gpu], cores=8, light=4)
    t, r = seats["trainer"], seats["rollout"]
    assert (t.gpu, r.gpu) == (0, 0)
    assert t.share + r.share <= (gpu.free - 2 * HEADROOM) / gpu.total
    assert t.share * gpu.total >= 10 * GIB and r.share * gpu.total >= 6 * GIB * 0.99
    # What is left beyond both needs is split evenly: the trainer gets its need plus half.
    spare = (23 - 2 - 16) / 2
    assert t.share == pytest.approx((10 + spare) / 24, abs=0.01)
    assert r.share == pytest.approx((6 + spare) / 24, abs=0.01)
    # An asked share is kept as asked; the other stage gets its need and all that is left.
    asked = place(needs(rollout_share=0.3), [gpu], cores=8)
    assert asked["rollout"].share == 0.3
    assert asked["trainer"].share == pytest.approx((23 - 2 - 0.3 * 24) / 24, abs=0.01)


def test_stages_asking_more_than_the_gpu_has_is_an_error_naming_them_and_their_memory():
    gpu = Gpu(0, 24 * GIB, 23 * GIB)
    with pytest.raises(PlacementError, match=r"trainer 10\.0 GiB \(need\), rollout 19\.2 GiB \(0\.80 asked\)"):
        place(needs(rollout_share=0.8), [gpu], cores=8)
    with pytest.raises(PlacementError, match=r"GPU 0 has 23\.0 GiB free of 24\.0 GiB"):
        place(needs(trainer=15 * GIB, rollout=8 * GIB), [gpu], cores=8)
    with pytest.raises(PlacementError, match=r"rollout asks 0\.10 of GPU 0 \(2\.4 GiB\) but needs about 6\.0 GiB"):
        place(needs(rollout_share=0.1), [gpu], cores=8)
    # Another process holding most of the GPU: what is free counts, not its size.
    with pytest.raises(PlacementError, match="2.0 GiB free"):
        place(needs(), [Gpu(0, 24 * GIB, 2 * GIB)], cores=8)


def test_a_real_model_shares_a_24_gb_gpu_and_a_big_one_does_not():
    gpu = Gpu(0, 24 * GIB, 23 * GIB)
    smol = place([Need("trainer", trainer_bytes(SMOL, 4096)), Need("rollout", engine_bytes(SMOL))], [gpu], 8)
    assert smol["trainer"].share + smol["rollout"].share <= 1
    # A 7 B model's fp32 AdamW state alone (16 bytes a parameter) is past 24 GB.
    big = ModelShape(params=7_600_000_000, hidden=3584, layers=28, vocab=152064)
    with pytest.raises(PlacementError, match="trainer"):
        place([Need("trainer", trainer_bytes(big, 4096)), Need("rollout", engine_bytes(big))], [gpu], 8)


def test_nvidia_smi_output_parses_to_gpus_in_bytes():
    text = "0, 81559, 80000\n1, 81559, 1024\nNo devices were found\n"
    assert parse_smi(text) == [Gpu(0, 81559 << 20, 80000 << 20), Gpu(1, 81559 << 20, 1024 << 20)]
    assert parse_smi("") == []


def test_a_seat_becomes_the_stage_flags_and_environment():
    gpu_seat, cpu_seat = Seat("rollout", 1, 0.42, 2), Seat("trainer", None, 0.0, 6)
    assert seat_flags(gpu_seat, "--gpu-memory-utilization") == ["--threads", "2", "--device", "cuda",
                                                                "--gpu-memory-utilization", "0.42"]
    assert seat_flags(cpu_seat, "--gpu-memory-fraction") == ["--threads", "6"]
    env = seat_env({"OMP_NUM_THREADS": "1", "X": "y"}, gpu_seat)
    assert env == {"OMP_NUM_THREADS": "2", "MKL_NUM_THREADS": "2", "X": "y", "CUDA_VISIBLE_DEVICES": "1"}
    assert "CUDA_VISIBLE_DEVICES" not in seat_env({}, cpu_seat)


def test_the_demo_places_on_the_cpu_when_asked_or_without_gpus():
    seats = demo_placement(DemoSettings(placement="cpu"))
    assert {n: s.gpu for n, s in seats.items()} == {"trainer": None, "rollout": None}
    assert all(s.threads >= 1 for s in seats.values())


def test_the_demo_gives_a_cpu_trainer_every_core_or_n_threads_when_asked(monkeypatch):
    import rlstream.demo as demo
    monkeypatch.setattr(demo, "cpu_cores", lambda: 8)
    placed = demo_placement(DemoSettings(placement="cpu"))
    assert placed["trainer"].threads < 8  # its share, beside the rollout's
    every = demo_placement(DemoSettings(placement="cpu", trainer_threads=-1))
    assert every["trainer"].threads == 8 and every["rollout"] == placed["rollout"]
    assert demo_placement(DemoSettings(placement="cpu", trainer_threads=3))["trainer"].threads == 3
    with pytest.raises(UserError, match="--trainer-threads -2: expected -1"):
        demo_placement(DemoSettings(placement="cpu", trainer_threads=-2))


def test_a_recipes_bf16_autocast_is_kept_only_where_the_trainer_has_bf16(capsys):
    from rlstream.demo import recipe_autocast
    cpu = DemoSettings(placement="cpu", recipe="smollm2", autocast="bf16")
    assert recipe_autocast(cpu, cpu_bf16=True).autocast == "bf16"
    assert recipe_autocast(cpu, cpu_bf16=False).autocast == "off"
    assert "no bf16 instructions" in capsys.readouterr().out
    off = DemoSettings(placement="cpu", autocast="off")
    assert recipe_autocast(off, cpu_bf16=False) is off


def test_cpu_bf16_is_read_from_the_cpus_flags():
    from rlstream.models.devices import cpu_has_bf16
    zen4 = "processor\t: 0\nflags\t\t: fpu sse2 avx2 avx512f avx512_bf16 avx512_vnni\n"
    assert cpu_has_bf16(zen4)
    assert cpu_has_bf16("flags : fpu avx2 amx_bf16 amx_tile\n")
    assert cpu_has_bf16("processor : 0\nFeatures : fp asimd sve bf16 i8mm\n")  # Arm
    assert not cpu_has_bf16("flags : fpu sse2 avx2 avx512f avx512_vnni\n")  # AVX-512 without its bf16 part
    assert not cpu_has_bf16("")


def test_a_stage_started_without_a_placement_runs_one_thread_unless_told(monkeypatch):
    from rlstream.infra.supervisor import stage_env
    from rlstream.models.devices import resolve_threads
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    env = stage_env("b:9092", "r")
    assert env["OMP_NUM_THREADS"] == "1" and resolve_threads(0, omp=env["OMP_NUM_THREADS"], cores=16) == 1
    assert stage_env("b:9092", "r", OMP_NUM_THREADS="4")["OMP_NUM_THREADS"] == "4"
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert stage_env("b:9092", "r")["OMP_NUM_THREADS"] == "3"


def test_the_flags_a_placement_gives_parse_for_their_stages():
    from rlstream import cli
    from rlstream.config import load
    from rlstream.stages.rollout import RolloutSettings
    from rlstream.trainer.settings import TrainerSettings
    trainer = cli.build_parser("trainer").parse_args(
        ["run", "trainer", *seat_flags(Seat("trainer", 0, 0.45, 2), "--gpu-memory-fraction")])
    t = load(TrainerSettings, trainer)
    assert (t.threads, t.device, t.gpu_memory_fraction) == (2, "cuda", 0.45)
    rollout = cli.build_parser("rollout").parse_args(
        ["run", "rollout", *seat_flags(Seat("rollout", 0, 0.4, 2), "--gpu-memory-utilization")])
    r = load(RolloutSettings, rollout)
    assert (r.threads, r.device, r.gpu_memory_utilization, r.enforce_eager) == (2, "cuda", 0.4, "auto")


def test_a_share_that_is_not_a_fraction_is_refused_by_stage():
    with pytest.raises(PlacementError, match="rollout: a GPU share of 1.5"):
        place(needs(rollout_share=1.5), [Gpu(0, 24 * GIB, 23 * GIB)], cores=8)
    from rlstream.trainer.service import TrainerService
    from rlstream.trainer.settings import TrainerSettings
    with pytest.raises(ValueError, match="--gpu-memory-fraction"):
        TrainerService(TrainerSettings(gpu_memory_fraction=0.0))
