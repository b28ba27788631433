"""harpjax: automatic pipeline-parallel training of JAX/Flax models on heterogeneous GPU clusters."""

import re
from pathlib import Path

from setuptools import find_packages, setup

VERSION = re.search(r'__version__ = "([^"]+)"',
                    (Path(__file__).parent / "harpjax" / "_version.py").read_text()).group(1)

# Versions tested together on CPU (fake devices); see README "Tested versions".
INSTALL_REQUIRES = [
    "jax==0.10.2",
    "jaxlib==0.10.2",
    "flax==0.12.8",
    "optax==0.2.8",
    "ray==2.60.0",
    "numba==0.68.1",
    "numpy==2.4.6",
    "pyyaml==6.0.3",
    "matplotlib==3.11.2",
    "tqdm==4.70.1",
    "click==8.5.1",
    "flatbuffers==25.12.19",   # jax.export serialisation (the Ray workers' lowered steps)
]

setup(
    name="harpjax",
    version=VERSION,
    description=__doc__,
    packages=find_packages(include=["harpjax", "harpjax.*"]),
    python_requires=">=3.10",
    install_requires=INSTALL_REQUIRES,
    extras_require={"test": ["pytest==9.2.0", "pytest-xdist==3.8.0", "hypothesis==6.170.15"]},
    entry_points={"console_scripts": ["harpjax=harpjax.cli:run"]},
)
