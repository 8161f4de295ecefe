# The testbed image: the controller and the worker agent, as docker-compose.yml runs them.
# Where Docker Hub is reachable:
#
#   docker compose build        (or: docker build -t edgetb-testbed:local .)
#
# Machines that reach no image registry build the same contents, same tag, from Debian's
# packages and PyPI: bash scripts/build_testbed_image.sh. The nodes themselves run from the node
# image (worker/Dockerfile, scripts/build_node_image.sh), not from this one.
FROM python:3.11-slim
RUN apt-get update \
 && apt-get install -y --no-install-recommends iproute2 procps \
 && rm -rf /var/lib/apt/lists/*
COPY pyproject.toml /opt/edgetb/
COPY scripts/deps.py /opt/edgetb/scripts/
RUN pip install --no-cache-dir $(python3 /opt/edgetb/scripts/deps.py docker)
COPY . /opt/edgetb
WORKDIR /opt/edgetb
ENV PYTHONDONTWRITEBYTECODE=1 LANG=C.UTF-8 PYTHONPATH=/opt/edgetb
LABEL org.edgetb.testbed-image=1
CMD ["python3", "-m", "worker.agent", "--help"]
