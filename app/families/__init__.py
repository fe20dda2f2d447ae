"""Model families, one data module each: markers, call syntax, prompt note, detection hints.

A family module (``qwen.py``) holds everything that depends on how that
family's models write: their reasoning block, their tool-call syntax (the
one ``CallSyntax`` the parser reads and the grammar forces), the sentence a
tool note uses to ask for it, and the chat-template and model-name hints that
detect it (``family.py`` draws how the parts use them). llama.cpp's
``common_chat_params_init_*`` sets the prompt, parse format and grammar of a
format together in the same way, so they cannot drift apart.

Why a package of its own: the engine's grammar (``app.engine.constrain.constraints``)
and the parsers both read the call syntax, and the engine must not import the
parsers (nor they the engine). So families sit below both, a leaf that
imports nothing of the app::

    api -> pipeline -> engine, parsers, vision, config
                       engine, parsers -> families

A family's module name, registry key and the ``tool_parser:`` /
``reasoning_parser:`` value in models.yaml are one string; users type it, so
a rename breaks configs. The modules sit in one subpackage per call shape
(``json_calls``, ``named_calls``, ``xml_calls``, ``other_calls``). Adding a
family is its module, its line below, and its recorded outputs in
``tests/fixtures/parsers/<name>.json``.
"""

from __future__ import annotations

from app.families.family import BARE_JSON, REASONING_MARKERS, THINK, Family, new_call_id
from app.families.json_calls import (
    apertus,
    apriel,
    cohere,
    firefunction,
    generic,
    gigachat,
    granite,
    llama,
    minimax_m1,
    nemotron,
    qwen,
)
from app.families.named_calls import deepseek_r1, deepseek_v3, functionary, kimi, mistral, solar
from app.families.other_calls import gemma4, gpt_oss, lfm2, llama4, muse
from app.families.syntax import CallSyntax, Syntax
from app.families.xml_calls import (
    deepseek_dsml,
    glm,
    hunyuan,
    kimi_k3,
    minicpm,
    minimax,
    minimax_m3,
    qwen3_coder,
    seed_oss,
)

# In detection order: a template is matched against each family's call syntax in turn
# (app.pipeline.detection), and the hints of the fallback are tried in this order too,
# generic (which reads every JSON shape) last.
FAMILIES: dict[str, Family] = {m.FAMILY.name: m.FAMILY for m in (
    gpt_oss, muse, kimi_k3, kimi, deepseek_dsml, deepseek_r1, deepseek_v3, minimax_m3, minimax, glm, hunyuan, seed_oss,
    qwen3_coder, minicpm, gemma4, lfm2, llama4, cohere, nemotron, apertus, apriel, minimax_m1, granite, solar, gigachat,
    functionary, firefunction, mistral, qwen, llama, generic,
)}
# The family of a model nothing detects.
DEFAULT = generic.FAMILY.name

__all__ = [
    "BARE_JSON",
    "DEFAULT",
    "FAMILIES",
    "REASONING_MARKERS",
    "THINK",
    "CallSyntax",
    "Family",
    "Syntax",
    "new_call_id",
]
