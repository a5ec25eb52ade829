"""``jaxlab devices``: what JAX sees on this host."""

from __future__ import annotations

from typing import Annotated, Any

import typer
from rich.table import Table

from jaxlab.cli.common import ConfigOpt, JsonOpt, SetOpt, console, emit_json, resolve


def register(app: typer.Typer) -> None:
    @app.command(epilog="Example: jaxlab devices --json")
    def devices(
        config: ConfigOpt = None,
        set_: SetOpt = None,
        cpu: Annotated[bool, typer.Option("--cpu", help="Force the CPU platform.")] = False,
        json_: JsonOpt = False,
    ) -> None:
        """Backend, devices, memory, CPU, XLA flags and library versions."""
        from jaxlab.parallel import build_mesh, check_model_fits, describe_mesh
        from jaxlab.runtime import configure_platform, device_inventory

        cfg = resolve(config, set_).config
        configure_platform("cpu" if cpu else cfg.runtime.platform)
        info = device_inventory()
        # The mesh this config would build here; a bad one is a config error (exit 2).
        mesh = build_mesh(cfg.parallel)
        check_model_fits(cfg.model, mesh)
        info["mesh"] = describe_mesh(mesh)
        if json_:
            emit_json(info)
            return
        render(info)


def render(info: dict[str, Any]) -> None:
    table = Table(title="jaxlab devices", show_header=False, title_justify="left")
    table.add_column("what", style="bold")
    table.add_column("value")
    for key in ("backend", "platform", "device_kind", "device_count", "local_device_count"):
        table.add_row(key.replace("_", " "), str(info[key]))
    table.add_row("process", f"{info['process_index']} of {info['process_count']}")
    for d in info["local_devices"]:
        mem = d.get("memory")
        mem_s = (
            f", {mem.get('bytes_in_use', 0) / 2**20:.0f} MiB used of "
            f"{mem.get('bytes_limit', 0) / 2**30:.1f} GiB"
            if mem
            else ", memory stats: not reported by this backend"
        )
        table.add_row(f"device {d['id']}", f"{d['platform']} {d['kind']}{mem_s}")
    if "mesh" in info:
        axes = info["mesh"]["axes"]
        table.add_row("mesh", " x ".join(f"{k}={v}" for k, v in axes.items()))
    simd = f", {info['cpu_simd']}" if info.get("cpu_simd") else ""
    table.add_row(
        "cpu", f"{info['cpu_model']} ({info['cpu_cores']} cores, {info['machine']}{simd})"
    )
    table.add_row("XLA_FLAGS", info["xla_flags"] or "(none)")
    table.add_row("JAX_PLATFORMS", info["jax_platforms"] or "(auto)")
    for name, version in info["versions"].items():
        table.add_row(name, version)
    console.print(table)
