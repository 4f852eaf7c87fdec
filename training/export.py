"""ONNX export of the controller, with its contract in ``metadata_props`` and a parity check."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
import torch

from uag.errors import UagError

PARITY_RTOL = 1e-3
PARITY_ATOL = 1e-5


def export_onnx(
    net: torch.nn.Module,
    path: Path,
    *,
    metadata: dict[str, Any],
    check_rows: np.ndarray,
    output_name: str = "p_accept",
) -> float:
    """Write ``path`` (input ``features`` [N, F] float32 → output ``output_name``: ``p_accept``
    [N] for a stop controller, ``expected_tokens`` [N, A] for a plan); return the largest
    |onnxruntime − torch| difference on ``check_rows``, failing if outside tolerance."""
    net = net.cpu().eval()
    path.parent.mkdir(parents=True, exist_ok=True)
    example = torch.from_numpy(check_rows[:2].astype(np.float32))
    tmp = path.with_name(f".{path.name}.tmp")
    torch.onnx.export(
        net,
        (example,),
        str(tmp),
        input_names=["features"],
        output_names=[output_name],
        dynamic_axes={"features": {0: "n"}, output_name: {0: "n"}},
        dynamo=False,
    )
    model = onnx.load(str(tmp))
    for key, value in metadata.items():
        entry = model.metadata_props.add()
        entry.key = key
        entry.value = value if isinstance(value, str) else json.dumps(value)
    onnx.save(model, str(tmp))
    session = ort.InferenceSession(str(tmp), providers=["CPUExecutionProvider"])
    got = session.run([output_name], {"features": check_rows.astype(np.float32)})[0]
    with torch.no_grad():
        want = net(torch.from_numpy(check_rows.astype(np.float32))).numpy()
    try:
        np.testing.assert_allclose(got, want, rtol=PARITY_RTOL, atol=PARITY_ATOL)
    except AssertionError as err:
        tmp.unlink(missing_ok=True)
        raise UagError(
            f"ONNX export disagrees with torch beyond rtol={PARITY_RTOL}, atol={PARITY_ATOL}: {str(err).splitlines()[3:5]}"
        ) from err
    tmp.replace(path)
    return float(np.abs(got - want).max()) if len(want) else 0.0
