"""The default model's own weights in another GGUF type: every layer matrix of SmolLM2-135M-Instruct
(its Q4_1 blocks dequantized) quantized by gguf-py to one type (Q8_0, Q5_0, Q5_1, Q4_0), the
embedding / head and the norms as in the file, every metadata key copied. Real weights, so that
precision can be measured on a file of that type (bench/precision.py --model), which the random
files of bench/random_gguf.py cannot give:

    .venv/bin/python -m bench.requantized [--type Q8_0]     # prints the path

Written once under the temporary folder and reused (~1 minute)."""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType as Q
from gguf import GGUFReader, GGUFWriter
from gguf.quants import dequantize, quantize

from engine.files import default_model_path

TYPES = ("Q8_0", "Q5_0", "Q5_1", "Q4_0")  # what gguf-py quantizes


def requantized(qtype: Q) -> Path:
    path = Path(tempfile.gettempdir()) / "strata-bench-cache" / f"smollm2-135m-real-{qtype.name}.gguf"
    if path.exists():
        return path
    path.parent.mkdir(exist_ok=True)
    source = GGUFReader(default_model_path())
    writer = GGUFWriter(path.with_suffix(".tmp"), str(source.fields["general.architecture"].contents()))
    for key, field in source.fields.items():
        if not key.startswith("GGUF.") and key != "general.architecture":
            writer.add_key_value(key, field.contents(), field.types[0],
                                 sub_type=field.types[1] if len(field.types) > 1 else None)
    for tensor in source.tensors:
        data = np.asarray(tensor.data)
        if tensor.name.startswith("blk.") and len(tensor.shape) == 2:
            shape = tuple(int(n) for n in reversed(tensor.shape.tolist()))  # [out, in]
            dense = dequantize(data, tensor.tensor_type).reshape(shape).astype(np.float32)
            writer.add_tensor(tensor.name, quantize(dense, qtype), raw_dtype=qtype)
        else:
            writer.add_tensor(tensor.name, data, raw_dtype=tensor.tensor_type, raw_shape=data.shape)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    path.with_suffix(".tmp").replace(path)
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--type", default="Q8_0", choices=TYPES)
    print(requantized(Q[parser.parse_args().type]))


if __name__ == "__main__":
    main()
