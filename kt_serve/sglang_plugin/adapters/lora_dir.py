"""``--kt-lora-dir DIR``: a request naming an adapter the server has not seen yet loads ``DIR/<name>`` first.

SGLang's tokenizer loads an adapter on use only when it was loaded once before (its cache of known adapters, which
``--max-loaded-loras`` unloads from); any other name is refused. With an adapter directory, a name that is a
subdirectory there joins that cache just before SGLang resolves the request, so SGLang's own load-on-use path loads
it, composite halves included (manager_hooks.py), and a bad adapter fails that one request with the reason.
"""

from __future__ import annotations

import os
import re

from ..config import KTServeConfig

_ADAPTER_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")  # a plain directory name: no separators, no "..", no "."


def find_on_first_use(manager, obj, *args, **kwargs):
    """BEFORE TokenizerManager._resolve_lora_path(obj): the request's unknown adapter names found under the directory
    become known adapters (name -> DIR/name)."""
    root = KTServeConfig.from_env().lora_dir  # read here: the launcher exports the flags after its hooks exist
    if not root or not obj.lora_path:
        return None
    from sglang.srt.lora.lora_registry import LoRARef

    names = [obj.lora_path] if isinstance(obj.lora_path, str) else obj.lora_path
    for name in names:
        if not name or name in manager.lora_ref_cache or not _ADAPTER_NAME.fullmatch(name):
            continue
        path = os.path.join(root, name)
        if os.path.isdir(path):
            manager.lora_ref_cache[name] = LoRARef(lora_name=name, lora_path=path, pinned=False)
    return None
