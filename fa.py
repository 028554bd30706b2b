import numpy as np, torch, traceback
from numaov.custom_ops.flash_attention import flash_attention as fa
r=np.random.default_rng(0)
def a(*s): return r.standard_normal(s).astype(np.float32)
def b(*s): return torch.randn(*s).to(torch.bfloat16)
cases = {
 'q rank3': lambda: fa(a(4,8,16),a(1,4,8,16),a(1,4,8,16)),
 'all rank5': lambda: fa(a(1,1,4,8,16),a(1,1,4,8,16),a(1,1,4,8,16)),
 'head_dim mismatch q/k': lambda: fa(a(1,4,8,16),a(1,4,8,32),a(1,4,8,32)),
 'v head dim differs': lambda: fa(a(1,4,8,16),a(1,4,8,16),a(1,4,8,32)),
 'k/v seq mismatch': lambda: fa(a(1,4,8,16),a(1,4,8,16),a(1,4,9,16)),
 'heads mismatch (GQA)': lambda: fa(a(1,4,8,16),a(1,2,8,16),a(1,2,8,16)),
 'batch mismatch': lambda: fa(a(2,4,8,16),a(1,4,8,16),a(1,4,8,16)),
 'bad layout name': lambda: fa(a(1,4,8,16),a(1,4,8,16),a(1,4,8,16),layouts=('bhsd','bhsd','bhsd','BSHD')),
 'layouts 3 items': lambda: fa(a(1,4,8,16),a(1,4,8,16),a(1,4,8,16),layouts=('bhsd','bhsd','bhsd')),
 'layouts str': lambda: fa(a(1,4,8,16),a(1,4,8,16),a(1,4,8,16),layouts='bhsd'),
 'wrong layout for shape (bshd claimed on bhsd k)': lambda: fa(a(1,4,8,16),a(1,4,10,16),a(1,4,10,16),layouts=('bhsd','bshd','bshd','bhsd')),
 'scale 0': lambda: fa(a(1,4,8,16),a(1,4,8,16),a(1,4,8,16),scale=0),
 'scale -1': lambda: fa(a(1,4,8,16),a(1,4,8,16),a(1,4,8,16),scale=-1.0),
 'scale nan': lambda: fa(a(1,4,8,16),a(1,4,8,16),a(1,4,8,16),scale=float('nan')),
 'scale inf': lambda: fa(a(1,4,8,16),a(1,4,8,16),a(1,4,8,16),scale=float('inf')),
 'scale str': lambda: fa(a(1,4,8,16),a(1,4,8,16),a(1,4,8,16),scale='0.25'),
 'scale np.float32(0)': lambda: fa(a(1,4,8,16),a(1,4,8,16),a(1,4,8,16),scale=np.float32(0)),
 'zero dim': lambda: fa(a(1,4,0,16),a(1,4,8,16),a(1,4,8,16)),
 'bf16 q, numpy k': lambda: fa(b(1,4,8,16),a(1,4,8,16),a(1,4,8,16)),
 'numpy q, bf16 k': lambda: fa(a(1,4,8,16),b(1,4,8,16),b(1,4,8,16)),
 'fp16 torch': lambda: fa(torch.randn(1,4,8,16).half(),torch.randn(1,4,8,16).half(),torch.randn(1,4,8,16).half()),
 'f32 torch requires_grad': lambda: fa(torch.randn(1,4,8,16,requires_grad=True),torch.randn(1,4,8,16),torch.randn(1,4,8,16)),
 'list input': lambda: fa([[1.0]], a(1,4,8,16), a(1,4,8,16)),
 'bf16 rank3': lambda: fa(b(4,8,16),b(4,8,16),b(4,8,16)),
 'head_dim 1000': lambda: fa(a(1,1,4,1000),a(1,1,4,1000),a(1,1,4,1000)),
 'head_dim 7 (odd)': lambda: fa(a(1,1,4,7),a(1,1,4,7),a(1,1,4,7)),
}
for name,f in cases.items():
    try:
        out=f(); print(f'[{name}] NO ERROR -> {type(out).__name__} {tuple(out.shape)}')
    except Exception as e:
        tb = traceback.extract_tb(e.__traceback__)[-1]
        print(f'[{name}] {type(e).__name__}: {e}  (raised at {tb.filename.split("/")[-1]}:{tb.lineno})')
