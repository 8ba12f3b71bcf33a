"""Every benchmark, declared: the result file, the module that measures it, its knobs and their defaults, its
smoke run's knobs, and what it needs (``bench.harness`` runs them; ``python -m bench list`` prints them)."""

from __future__ import annotations

from bench.harness import Scenario

_SCALE = {"seconds": 6.0, "ramp": 1.5, "workers": "", "modes": "thread,process", "resize": "on,off", "load_procs": 0,
          "first": "on"}  # workers "": 1, 2, 4, 8 and cores - 2 within the usable cores; load_procs 0: cores / 8
_FRONT = {"processes": "1,2,4", "seconds": 4.0, "warmup": 1.0, "clients": 0, "streams": 256, "sse_delay": 0.01,
          "paced_streams": 24, "paced_rate": 200.0, "conns": 32, "upstreams": 0, "turns": 10}
_SWEEP = {"clients": 64, "per_client": 2, "gates": "off,1,2,4,8", "release_at": "complete",
          "preprocess_timeout": 600.0, "no_extra": False, "quiet_wait": 10.0}
_SOAK = {"requests": 10_000, "clients": 16, "variants": "default,untuned,untuned-no-trim", "seed": 42, "warmup": 0.1,
         "checkpoint_every": 1000, "settle": 1.5, "trim_timeout": 10.0, "append": False}
_SOAK_SMOKE = {"requests": 200, "checkpoint_every": 100, "variants": "default"}
_REAL_VLLM = {"profile": "single", "vllm_url": "", "vllm_pid": 0, "sizes": "", "formats": "", "concurrency": ""}

SCENARIOS: tuple[Scenario, ...] = (
    Scenario("sniff", "sniff", {"rounds": 5}, quick={"rounds": 1}),
    Scenario("locate", "locate", {"runs": 31}, quick={"runs": 3}),
    Scenario("image_pipeline", "image_pipeline", {"repeat": 5}, quick={"repeat": 3}),
    Scenario("fidelity", "fidelity", notes="needs the model extra"),
    Scenario("gil_hold", "gil_hold", {"seconds": 3.0, "sequential": 20, "malloc_tuning": "on"},
             quick={"seconds": 0.3, "rounds": 1, "sequential": 3}),
    Scenario("fuzz", "fuzz", {"examples": 3000, "minutes": 0.0, "properties": "", "seed": -1, "save": True},
             quick={"examples": 10, "save": False}, notes="properties '': all of them; seed -1: a random one"),
    Scenario("loop_latency", "loop_latency", {"seconds": 10.0, "interval": 0.01, "clients": 16, "ramp": 1.5,
                                              "quiet_wait": 3.0, "only": "", "pinned": False},
             quick={"seconds": 1.0, "rounds": 1}),
    Scenario("pacing", "pacing", {"seconds": 8.0, "interval": 0.01, "clients": 16, "ramp": 1.5, "quiet_wait": 3.0,
                                  "only": ""}, quick={"seconds": 2.0, "rounds": 1}),
    Scenario("loop_stall", "loop_stall", {"sizes": "8,35,50", "kinds": "image_flood,text_flood,deep,invalid,big_image",
                                          "interval": 0.002, "baseline_ref": "a573611"},
             quick={"rounds": 1, "sizes": "2,8"}, notes="measures main (git archive) beside this tree"),
    Scenario("metrics_flood", "metrics_flood", {"sizes_kb": "300,4000", "seconds": 5.0, "interval": 0.01, "clients": 8},
             quick={"rounds": 1, "seconds": 1.0, "sizes_kb": "300"}),
    Scenario("scale", "scale", _SCALE, quick={"seconds": 1.0, "rounds": 1},
             notes="the 14-worker goals need 16 cores: scale_16cores measures them"),
    Scenario("scale_16cores", "scale", _SCALE | {"workers": "1,14", "resize": "on", "first": "off"}, quick=None,
             cores=16, notes="the 16-core cells alone: the whole bench there takes about 11 minutes"),
    Scenario("cache", "cache", {"turns": 10, "small": False}, quick={"small": True, "rounds": 1}),
    Scenario("front", "front", _FRONT, quick={"rounds": 1, "seconds": 1.0, "warmup": 0.5, "processes": "1,2",
                                              "turns": 3},
             notes="the 8-process goals need 16 cores: front_16cores measures them"),
    Scenario("front_16cores", "front", _FRONT | {"processes": "1,8"}, quick=None, cores=16),
    Scenario("passthrough", "passthrough", {"duration": 9.0, "sse_rounds": 3, "no_profile": False,
                                            "quiet_budget": 40.0, "sse_streams": 64, "sse_tokens": 100,
                                            "sse_delay": 0.01, "baseline": ""},
             quick={"duration": 2.0, "rounds": 2, "sse_rounds": 1, "no_profile": True},
             notes="needs nginx and wrk (Debian packages); baseline: a git revision measured beside"),
    Scenario("gate_sweep", "gate_sweep", _SWEEP, quick={"rounds": 1, "gates": "off,2"}),
    Scenario("peak_rss", "gate_sweep", _SWEEP | {"clients": 128, "per_client": 1, "one_repeats": 2, "repeats": 3},
             quick={"rounds": 1}, functions=("measure_memory", "memory_goals", "render_memory")),
    Scenario("malloc_arenas", "malloc_arenas", {"requests": 200, "clients": 8, "workers": "2,4", "idle": 5.0,
                                                "variants": "default,arena2,mmap1m,blocks0,mmap1m+blocks0,"
                                                            "arena2+blocks0,jemalloc,shipped", "append": False},
             quick={"requests": 16, "workers": "2", "variants": "default,shipped", "idle": 1.0}),
    Scenario("soak", "soak", _SOAK, quick=_SOAK_SMOKE),
    Scenario("soak_cost", "soak", _SOAK | {"requests": 3000, "variants": "default,untuned"}, quick=_SOAK_SMOKE),
    Scenario("soak_long", "soak", _SOAK | {"requests": 30_000, "variants": "default"}, quick=_SOAK_SMOKE),
    Scenario("video_probe", "video_probe"),
    Scenario("checkpoints", "checkpoints", {"checkpoints": "Qwen2.5-VL,Qwen3-VL,Idefics3,Gemma 3",
                                            "images": "photo,camera", "clients": 4, "requests": 160},
             quick={"rounds": 1, "requests": 8},
             notes="the model mode with real checkpoints' configurations against the stub, 6 to 10 minutes on 2 cores"),
    Scenario("default_limit", "default_limit", {"limits": "2,4,8,16,auto", "clients": "8,32", "requests": 128},
             quick={"rounds": 1, "requests": 8, "clients": "8", "limits": "2,auto"},
             notes="the default MMGATE_MAX_MM_CONCURRENCY against 2 to 16, about 9 minutes on 2 cores"),
    Scenario("startup", "startup", {"rounds": 5, "baseline_ref": "ed6881d", "checkpoint": "Idefics3"},
             quick={"rounds": 1}, notes="measures the base commit (git archive) beside this tree"),
    Scenario("fleet", "fleet", quick={"rounds": 1}),
    Scenario("fleet_vllm", "fleet_vllm", {"limits": "1,2,4,8,12", "prompts": 256, "concurrency": 16,
                                          "vllm_url": ""},
             quick={"rounds": 1, "limits": "2", "prompts": 8}, vllm=True),
    Scenario("model_tokens", "model_tokens", {"vllm": True, "vllm_url": "", "requests": 8, "concurrency": 2},
             quick={"vllm": False}, vllm=True, notes="vllm off: the local parts alone"),
    Scenario("real_vllm", "real_vllm", _REAL_VLLM, vllm=True, notes="sizes, formats, concurrency '': all"),
    Scenario("real_vllm_tiles", "real_vllm", _REAL_VLLM | {"profile": "tiles"}, vllm=True),
    Scenario("peer_client", "peer_client", {"backends": "stub,stub-frontend,vllm,vllm-hf",
                                            "images": "noise,photo,camera", "clients": "1,8",
                                            "requests_per_client": 4, "min_requests": 6},
             quick={"rounds": 1, "clients": "1"}, vllm=True,
             notes="vllm bench serve, the peer client, from the real vLLM's venv"),
)
