"""The Kubernetes API client the scheduler finds its workers with
(services/common/kube.py, shared with the tokenizer); it logs as this module."""
from __future__ import annotations

import logging

from services.common import kube
from services.common.kube import (  # noqa: F401 - the scheduler's names for them
    API_URL_ENV,
    Gone,
    KubeApi,
    KubeApiError,
    KubeConfigError,
    Slices,
)


class EndpointSliceWatcher(kube.EndpointSliceWatcher):
    log = logging.getLogger(__name__)
