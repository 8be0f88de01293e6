# The training image both cluster manifests name (cluster/manifests/): Ray's GPU image (NVIDIA CUDA user space,
# Python 3.11, the tools KubeRay's probes use) with the locked CUDA stack and this project installed as a package
# in /app/.venv, first on PATH (`ray`, `python`, `pretrain`). Build and push: docs/multi-node.md, "The image".
#
#   docker build -t REGISTRY/pretrain:VERSION . && docker push REGISTRY/pretrain:VERSION
FROM rayproject/ray:2.60.0-py311-gpu

# PRETRAIN_TORCH=cuda: requirements-cuda.lock (the image is built where no GPU driver is); DS_BUILD_OPS=0:
# DeepSpeed's ops are JIT-built where first used, never at install.
ENV PRETRAIN_TORCH=cuda \
    DS_BUILD_OPS=0 \
    PATH=/app/.venv/bin:$PATH

USER root
RUN mkdir -p /app && chown ray:users /app
USER ray
WORKDIR /app

# The dependency layer: the launcher, the locks, the package skeleton and setup's Python half (cluster/install.py
# and what it imports). `./launch.sh setup` installs exactly requirements-cuda.lock, every file hash-checked (uv,
# fetched by pip and checked against its pin in the lock), then this project, editable: its code is the COPY below,
# so a code change does not reinstall the stack.
COPY --chown=ray:users launch.sh pyproject.toml requirements.txt requirements-torch.txt requirements.lock \
     requirements-cuda.lock ./
COPY --chown=ray:users pretrain/__init__.py pretrain/
COPY --chown=ray:users cluster/__init__.py cluster/install.py cluster/lockfile.py cluster/wheelhouse.py \
    cluster/environment.py cluster/
COPY --chown=ray:users eval/__init__.py eval/
COPY --chown=ray:users benchmarks/__init__.py benchmarks/
RUN ./launch.sh setup && rm -rf /home/ray/.cache/uv \
    && .venv/bin/python -c "import torch; assert torch.version.cuda, torch.__version__"

COPY --chown=ray:users . .
# The console command runs the installed package (the image's Python, no PYTHONPATH).
RUN pretrain --help >/dev/null
