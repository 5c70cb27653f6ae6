"""Lane-by-lane model of megaloop/codegen/include/megaloop/mma.cuh (ldmatrix addressing, the
3-stage slice -> stage mapping, mma.m16n8k16 fragment layouts from the PTX ISA, edge masking),
checked against A @ B.T. It mirrors the header's index arithmetic, not the compiled code: keep the
two in step when either changes, and run it (python scripts/emulation/mma.py) before a GPU run."""
import numpy as np, itertools
LD, BK, S = 40, 32, 3
def ptx_A(i, g, q):
    return (g if (i < 2 or 4 <= i < 6) else g + 8), 2 * q + (i & 1) + (8 if i >= 4 else 0)
def ptx_B(i, g, q):
    return 2 * q + (i & 1) + (8 if i >= 2 else 0), g
def ptx_C(i, g, q):
    return g + (8 if i >= 2 else 0), 2 * q + (i & 1)
def ldmatrix(smem, addrs, nmat):
    """addrs[lane] = element address of the row that lane supplies. Returns regs[lane][m] = (e0, e1)."""
    out = [[None] * nmat for _ in range(32)]
    for m in range(nmat):
        for t in range(32):
            row_addr = addrs[8 * m + t // 4]
            out[t][m] = (smem[row_addr + 2 * (t % 4)], smem[row_addr + 2 * (t % 4) + 1])
    return out
def tile(A, B, BM, BN, WM, WN):
    rows, K = A.shape; cols = B.shape[0]
    FM, FN = BM // 16 // WM, BN // 8 // WN
    C = np.full((rows, cols), np.nan)
    slices = (K + BK - 1) // BK
    for r0 in range(0, rows, BM):
        for c0 in range(0, cols, BN):
            nr, nc = min(BM, rows - r0), min(BN, cols - c0)
            sA = np.full(S * BM * LD, np.nan); sB = np.full(S * BN * LD, np.nan)
            def stage(sl):
                st = sl % S
                for r in range(BM):
                    for kc in range(0, BK, 8):
                        ok = r < nr and sl * BK + kc < K
                        sA[st*BM*LD + r*LD + kc: st*BM*LD + r*LD + kc + 8] = A[r0 + r, sl*BK+kc: sl*BK+kc+8] if ok else 0
                for r in range(BN):
                    for kc in range(0, BK, 8):
                        ok = r < nc and sl * BK + kc < K
                        sB[st*BN*LD + r*LD + kc: st*BN*LD + r*LD + kc + 8] = B[c0 + r, sl*BK+kc: sl*BK+kc+8] if ok else 0
            acc = {}
            for sl in range(min(S - 1, slices)): stage(sl)
            for s in range(slices):
                nxt = s + S - 1
                # compute on stage s % S BEFORE the next load lands? In the kernel the load of `nxt` is
                # issued after the barrier and goes to stage nxt % S != s % S: emulate it first to prove
                # it does not disturb this step's stage.
                if nxt < slices: stage(nxt)
                assert nxt % S != s % S
                for warp in range(WM * WN):
                    wm, wn = warp // WN, warp % WN
                    as_ = (s % S) * BM * LD + (wm * FM * 16) * LD
                    bs = (s % S) * BN * LD + (wn * FN * 8) * LD
                    for ks in range(0, BK, 16):
                        af = {}
                        for i in range(FM):
                            base = as_ + i * 16 * LD + ks
                            addrs = [base + (l & 15) * LD + (l >> 4) * 8 for l in range(32)]
                            af[i] = ldmatrix(sA, addrs, 4)
                        bf = {}
                        j = 0
                        while j + 1 < FN:
                            base = bs + j * 8 * LD + ks
                            addrs = [base + ((l & 7) + ((l >> 4) << 3)) * LD + ((l >> 3) & 1) * 8 for l in range(32)]
                            r = ldmatrix(sB, addrs, 4)
                            bf[j] = [[r[t][0], r[t][1]] for t in range(32)]
                            bf[j + 1] = [[r[t][2], r[t][3]] for t in range(32)]
                            j += 2
                        if FN % 2:
                            base = bs + (FN - 1) * 8 * LD + ks
                            addrs = [base + (l & 7) * LD + ((l >> 3) & 1) * 8 for l in range(32)]
                            r = ldmatrix(sB, addrs, 2)
                            bf[FN - 1] = [[r[t][0], r[t][1]] for t in range(32)]
                        for i, jj in itertools.product(range(FM), range(FN)):
                            At = np.full((16, 16), np.nan); Bt = np.full((16, 8), np.nan)
                            for t in range(32):
                                g, q = t >> 2, t & 3
                                for ri in range(4):
                                    for e in range(2):
                                        rr, cc = ptx_A(2 * ri + e, g, q); At[rr, cc] = af[i][t][ri][e]
                                for ri in range(2):
                                    for e in range(2):
                                        kk, nn = ptx_B(2 * ri + e, g, q); Bt[kk, nn] = bf[jj][t][ri][e]
                            assert not np.isnan(At).any() and not np.isnan(Bt).any()
                            D = At @ Bt
                            for t in range(32):
                                g, q = t >> 2, t & 3
                                for e in range(4):
                                    rr, cc = ptx_C(e, g, q)
                                    key = (warp, i, jj, t, e); acc[key] = acc.get(key, 0.0) + D[rr, cc]
            for (warp, i, jj, t, e), v in acc.items():
                wm, wn = warp // WN, warp % WN; g, q = t >> 2, t & 3
                r = wm * FM * 16 + i * 16 + g; c = wn * FN * 8 + jj * 8 + 2 * q
                rr, cc = r + (e >> 1) * 8, c + (e & 1)
                if rr < nr and cc < nc:
                    assert np.isnan(C[r0 + rr, c0 + cc]); C[r0 + rr, c0 + cc] = v
    return C
rng = np.random.default_rng(0)
for (rows, cols, K, BM, BN, WM, WN) in [(40, 24, 72, 64, 32, 4, 2), (200, 144, 136, 128, 128, 2, 4),
                                        (17, 9, 8, 32, 64, 2, 4), (128, 8, 40, 128, 8, 8, 1), (33, 130, 24, 16, 64, 1, 8),
                                        (64, 24, 96, 64, 24, 4, 1), (16, 40, 200, 16, 40, 1, 1)]:
    if (BN // 8) % WN or (BM // 16) % WM: print("skip", BM, BN, WM, WN); continue
    A = rng.integers(-3, 4, (rows, K)).astype(float); B = rng.integers(-3, 4, (cols, K)).astype(float)
    C = tile(A, B, BM, BN, WM, WN)
    assert not np.isnan(C).any(), "unwritten outputs"
    assert np.array_equal(C, A @ B.T), (rows, cols, K)
    print("ok", rows, cols, K, BM, BN, WM, WN, "FN", BN // 8 // WN)
