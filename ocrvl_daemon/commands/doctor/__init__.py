"""`ocrvl doctor`: every check, and how to fix each problem (`run` runs them)."""

from ocrvl_daemon.commands.doctor.report import Check, DoctorReport, render_json, render_text
from ocrvl_daemon.commands.doctor.run import run_doctor

__all__ = ["Check", "DoctorReport", "render_json", "render_text", "run_doctor"]
