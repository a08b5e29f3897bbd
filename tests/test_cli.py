import subprocess
import sys


def run_cli(*args):
    return subprocess.run([sys.executable, "-m", "moemesh.cli", *args], capture_output=True, text=True, timeout=300)


def test_generate_prints_the_greedy_completion(smollm):
    from moemesh import SamplingParams

    expected = smollm.generate("The capital of France is", SamplingParams(temperature=0.0, max_tokens=8))[0].text
    result = run_cli("generate", "The capital of France is", "--max-tokens", "8", "--dtype", "float32")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == expected.strip()


def test_bad_arguments_exit_with_a_message():
    result = run_cli("generate", "hi", "--model", "/nonexistent.gguf")
    assert result.returncode == 2 and "does not exist" in result.stderr
    result = run_cli("generate", "hi", "--max-tokens", "0")
    assert result.returncode == 2 and "max_tokens" in result.stderr


def test_bad_speculation_flags_exit_with_a_message():
    result = run_cli("generate", "hi", "--speculative-method", "draft")
    assert result.returncode == 2 and "needs --draft-model" in result.stderr
    result = run_cli("generate", "hi", "--num-speculative-tokens", "17")
    assert result.returncode == 2 and "--num-speculative-tokens must be in [1, 16]" in result.stderr
    result = run_cli("generate", "hi", "--speculative-method", "eagle")
    assert result.returncode == 2 and "invalid choice: 'eagle'" in result.stderr
    result = run_cli("serve", "--role", "decode", "--speculative-method", "draft", "--draft-model", "/nonexistent")
    assert result.returncode == 2 and "--draft-model '/nonexistent' does not exist" in result.stderr


def test_generate_passes_the_speculation_flags_to_the_engine(monkeypatch, capsys):
    from types import SimpleNamespace

    import moemesh.engine.llm
    from moemesh import cli
    from moemesh.engine.config import SpecConfig

    seen = {}

    class RecordingLLM:
        def __init__(self, **kwargs):
            seen.update(kwargs)

        def generate(self, prompts, params):
            return [SimpleNamespace(text="done") for _ in prompts]

    monkeypatch.setattr(moemesh.engine.llm, "LLM", RecordingLLM)
    flags = ["--speculative-method", "ngram", "--num-speculative-tokens", "3", "--speculative-scheduling", "fixed"]
    assert cli.main(["generate", "hi", *flags]) == 0
    assert seen["speculative"] == SpecConfig(method="ngram", num_speculative_tokens=3, scheduling="fixed")
    assert capsys.readouterr().out.strip() == "done"


def test_the_otlp_endpoint_comes_from_the_flag_else_the_mesh_config_else_the_standard_variable(tmp_path):
    import json

    from moemesh.cli import build_parser
    from moemesh.router.settings import router_settings
    from moemesh.worker.settings import worker_settings

    config = tmp_path / "mesh.json"
    config.write_text(json.dumps({"otlp_endpoint": "collector:4317"}))
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://env-collector:4317"}

    def endpoint(*flags, env=env, build=worker_settings, role="decode"):
        args = build_parser().parse_args(["serve", "--role", role, *flags])
        return build(args, env=env).mesh.otlp_endpoint

    assert endpoint() == "http://env-collector:4317"
    assert endpoint(env={}) is None
    assert endpoint("--config", str(config)) == "collector:4317"
    assert endpoint("--config", str(config), "--otlp-endpoint", "flag:4317") == "flag:4317"
    assert endpoint("--otlp-endpoint", "flag:4317", build=router_settings, role="router") == "flag:4317"
