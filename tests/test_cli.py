import subprocess
import sys


def run_cli(*args):
    return subprocess.run([sys.executable, "-m", "moemesh.cli", *args], capture_output=True, text=True, timeout=300)


def test_generate_prints_the_greedy_completion(smollm):
    from moemesh import SamplingParams

    expected = smollm.generate("The capital of France is", SamplingParams(temperature=0.0, max_tokens=8))[0].text
    result = run_cli("generate", "The capital of France is", "--max-tokens", "8")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == expected.strip()


def test_bad_arguments_exit_with_a_message():
    result = run_cli("generate", "hi", "--model", "/nonexistent.gguf")
    assert result.returncode == 2 and "does not exist" in result.stderr
    result = run_cli("generate", "hi", "--max-tokens", "0")
    assert result.returncode == 2 and "max_tokens" in result.stderr
