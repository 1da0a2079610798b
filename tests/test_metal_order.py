"""The Metal kernels' summation order, read from metal_kernels/attention.metal itself and compared with
the order the numpy emulation computes (kernels.LANES, DOT_BUTTERFLY, WARP_TOTALS_BUTTERFLY, THREADS) and
with the exact math the contract names (kernels.EXACT_MATH). No Metal GPU runs here, so nothing else can
see a change of order in that file: reversing a butterfly there, or taking fast::exp, fails here."""

import re

import pytest

from mlxinfer import kernels


def _source():
    """(header, bodies) of the Metal source without comments, its #define'd integers substituted."""
    header, bodies = kernels.kernel_source("metal")
    header = kernels.strip_comments(header)
    defines = dict(re.findall(r"(?m)^#define (\w+) (\d+)$", header))

    def subst(text):
        return re.sub(r"\b(" + "|".join(defines) + r")\b", lambda m: defines[m.group(1)], text)

    return subst(header), {n: subst(kernels.strip_comments(b)) for n, b in bodies.items()}


def _function(header: str, name: str) -> str:
    """The text of the header function `name`, from its signature to its closing brace at column 0."""
    m = re.search(r"(?ms)^[^\n]*\b" + name + r"\(.*?^}", header)
    assert m, f"{name} is not defined in attention.metal's header"
    return m.group(0)


LOOP = re.compile(r"for \((?:const )?(?:ushort|uint|int|long) (\w+) = ([^;]+); ([^;]+); ([^)]+)\)")


def _offsets(init: str, cond: str, step: str, var: str) -> tuple[int, ...]:
    """The values a loop's variable takes (a C loop header over integers, evaluated in Python)."""
    step = re.sub(r"^\+\+(\w+)$|^(\w+)\+\+$", r"\1\2 += 1", step.strip())
    step = re.sub(r"^--(\w+)$|^(\w+)--$", r"\1\2 -= 1", step).replace("/=", "//=")
    env, seen = {var: eval(init, {})}, []  # noqa: S307 (our own source's loop header)
    while eval(cond.replace("&&", " and ").replace("||", " or "), {}, env):  # noqa: S307
        seen.append(env[var])
        exec(step, {}, env)  # noqa: S102
        assert len(seen) <= 64, f"loop over {var} does not end: {init}; {cond}; {step}"
    return tuple(seen)


def _loops(text: str, marker: str, var: str = "off"):
    """[(variable, init, cond, step)] of the loops whose body (a braced block or one statement) contains
    `marker` and whose variable is `var`."""
    out = []
    for m in LOOP.finditer(text):
        rest = text[m.end():].lstrip()
        if rest.startswith("{"):
            depth = 0
            for end, ch in enumerate(rest):
                depth += {"{": 1, "}": -1}.get(ch, 0)
                if depth == 0:
                    break
            body = rest[:end + 1]
        else:
            body = rest.split(";", 1)[0]
        if marker in body and m.group(1) == var:
            out.append((m.group(1), m.group(2), m.group(3), m.group(4)))
    return out


def _butterflies(text: str, accumulator: str):
    """The offset sequences of every `acc = acc + simd_shuffle_xor(acc, off)` loop in text."""
    marker = f"{accumulator} = {accumulator} + simd_shuffle_xor({accumulator}, off)"
    return [_offsets(i, c, s, v) for v, i, c, s in _loops(text, marker)]


def test_every_shuffle_of_the_metal_source_is_a_butterfly_this_test_reads():
    """Every simd_shuffle_xor in the Metal source is inside a loop this file reads (a new reduction the
    emulation does not model fails here, instead of passing unseen)."""
    header, bodies = _source()
    text = header + "".join(bodies.values())
    read = sum(len(_butterflies(text, acc)) for acc in ("s", "total")) + len(
        _loops(text, "m = metal::max(m, simd_shuffle_xor(m, off))"))
    assert text.count("simd_shuffle_xor(") == read == 5


def test_metal_qk_norm_rope_order_is_cudas():
    """qk_norm_rope's sum of squares (Metal's twin of attention.cu's): lane l squares its values d = l +
    LANES i in increasing i, each product rounded then added, then the butterfly DOT_BUTTERFLY
    (mlxi_simd_total, as CUDA's mlxi_warp_total); the normalized value and its product by the weight each
    rounded to the type (mlxi_in), as in attention.cu."""
    header, bodies = _source()
    assert _butterflies(_function(header, "mlxi_simd_total"), "s") == [kernels.DOT_BUTTERFLY]
    body = bodies["qk_norm_rope"]
    assert re.search(r"for \(int i = 0; i < E; \+\+i\) \{\s*v\[i\] = float\(x\[lane \+ (\d+) \* i\]\);\s*"
                     r"const float sq = v\[i\] \* v\[i\];\s*ss = ss \+ sq;", body).group(1) == str(kernels.LANES)
    assert "mlxi_simd_total(ss)" in body
    assert "v[i] = mlxi_in(y, float(wt[lane + 32 * i]) * mlxi_in(y, v[i] * inv));" in body
    cuda = kernels.kernel_source("cuda")[1]["qk_norm_rope"]
    assert "mlxi_warp_total(ss)" in cuda and "ss = __fadd_rn(ss, __fmul_rn(v[i], v[i]));" in cuda


def test_metal_dot_product_order_is_the_emulations():
    """mlxi_dot: lane l sums the products l, l + LANES, ...; then the butterfly DOT_BUTTERFLY."""
    header, _ = _source()
    dot = _function(header, "mlxi_dot")
    (stride,) = re.findall(r"for \(int i = lane; i < n; i \+= (\d+)\)", dot)
    assert int(stride) == kernels.LANES
    assert re.search(r"const float prod = float\(a\[[^]]+\]\) \* float\(b\[[^]]+\]\);\s*s = s \+ prod;", dot)
    assert _butterflies(dot, "s") == [kernels.DOT_BUTTERFLY]


def test_metal_softmax_order_is_the_emulations():
    """mlxi_softmax: thread t sums e_j for j = t, t + THREADS, ...; the butterfly in each simdgroup,
    then over the 8 simdgroup totals (WARP_TOTALS_BUTTERFLY), lane l starting from total l mod 8."""
    header, _ = _source()
    soft = _function(header, "mlxi_softmax")
    sums = re.findall(r"for \(int j = tid; j < n; j \+= (\d+)\) \{\s*const float e = ([\w:]+)\(x\[j\] - m\);"
                      r"\s*x\[j\] = e;\s*s = s \+ e;", soft)
    assert [int(t) for t, _ in sums] == [kernels.THREADS]
    assert _butterflies(soft, "s") == [kernels.DOT_BUTTERFLY]
    assert _butterflies(soft, "total") == [kernels.WARP_TOTALS_BUTTERFLY]
    assert f"float total = red[lane & {len(kernels.WARP_TOTALS_BUTTERFLY) and kernels.THREADS // kernels.LANES - 1}];" in soft


def test_metal_fused_context_is_the_dot_products_order():
    """fused_attention's context value d: chain l sums p_i v_i for i = l, l + LANES, ... (as mlxi_dot),
    then the chains pairwise as a tree, part[l] + part[l + off] for off in DOT_BUTTERFLY: lane 0 of that
    butterfly. Its scores and softmax are mlxi_dot and mlxi_softmax."""
    _, bodies = _source()
    fused = bodies["fused_attention"]
    (stride,) = re.findall(r"for \(int i = l; i < S; i \+= (\d+)\) \{\s*const float prod = pr\[i\] \* mlxi_kv\(v, row0 \+ i, "
                           r"c0 \+ d, kvw\);\s*s = s \+ prod;", fused)
    assert int(stride) == kernels.LANES
    trees = [_offsets(i, c, s, v) for v, i, c, s in _loops(fused, "part[idx] = part[idx] + part[idx + off * dn]")]
    assert trees == [kernels.DOT_BUTTERFLY]
    assert "mlxi_score(mlxi_dot(qh, 1, mlxi_kv_row_at(k, row0 + j, c0, kvw), 1, D, lane), sc, softcap," in fused and "mlxi_softmax(pr, S, tid, red)" in fused


def test_metal_math_is_the_exact_math_the_contract_names():
    """Every exp and division of a float in the Metal source is the correctly rounded one the contract
    publishes (precise::, not fast:: or the default, whose ulps Metal leaves open), and fp contraction
    (fma) and reassociation are off for the whole file. (That no float is divided by '/':
    tests/test_metal_build.py, on clang's reading.) qk_norm_rope is not attention's arithmetic: it takes
    the functions of MLX's own Metal rms_norm and rope (precise::rsqrt and exp2, fast::cos and sin), and is
    checked against them within a bound at first use, not for its bits."""
    header, bodies = _source()
    text = header + "".join(b for n, b in bodies.items() if n != "qk_norm_rope")
    qk = bodies["qk_norm_rope"]
    assert re.findall(r"metal::(?:precise|fast)::\w+\(", qk) == [
        "metal::precise::rsqrt(", "metal::precise::divide(", "metal::precise::exp2(", "metal::precise::divide(",
        "metal::fast::cos(", "metal::fast::sin("]
    calls = re.findall(r"[\w:]*\b(?:exp|exp2|divide|log|recip|tanh)\(", text)
    assert calls and set(calls) <= {f"{f}(" for f in kernels.EXACT_MATH}, calls
    assert "#pragma clang fp contract(off)" in header and "#pragma clang fp reassociate(off)" in header


@pytest.mark.parametrize("reversed_text", [
    ("for (ushort off = 16; off > 0; off >>= 1) {\n    s = s + simd_shuffle_xor(s, off);",
     "for (ushort off = 1; off < 32; off <<= 1) {\n    s = s + simd_shuffle_xor(s, off);"),
    ("for (ushort off = 4; off > 0; off >>= 1) total", "for (ushort off = 1; off < 8; off <<= 1) total")])
def test_the_reader_sees_a_reversed_butterfly(reversed_text, monkeypatch):
    """The reading itself bites: the source with a butterfly reversed reads as the reversed order."""
    header, bodies = kernels.kernel_source("metal")
    old, new = reversed_text
    assert header.count(old) == 1
    monkeypatch.setattr(kernels, "kernel_source", lambda kind: (header.replace(old, new), bodies))
    h, _ = _source()
    got = _butterflies(h, "s" if "s = s" in old else "total")
    assert tuple(reversed(kernels.DOT_BUTTERFLY if "s = s" in old else kernels.WARP_TOTALS_BUTTERFLY)) in got
