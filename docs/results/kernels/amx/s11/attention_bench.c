// attention micro-benchmark: includes the kernel source (QSRC) for one variant; SmolLM2 shapes
#include QSRC
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
static double now(){struct timespec t;clock_gettime(CLOCK_MONOTONIC,&t);return t.tv_sec+t.tv_nsec*1e-9;}
static uint16_t h(float f){return _cvtss_sh(f, 0);}
int main(int argc, char** argv){
  int heads=argc>4?atoi(argv[4]):9, kvh=argc>5?atoi(argv[5]):3, d=argc>6?atoi(argv[6]):64; int ctx=atoi(argv[1]); int reps=atoi(argv[2]); const char* dump = argc>3?argv[3]:NULL; int L=30*9*64/(heads*d);
  int64_t plane=ctx+16;
  uint16_t* kc=malloc(2*L*kvh*plane*d), *vc=malloc(2*L*kvh*plane*d);
  srand(1);
  for(int64_t i=0;i<L*kvh*plane*d;i++){kc[i]=h((rand()/(float)RAND_MAX-0.5f)*4); vc[i]=h((rand()/(float)RAND_MAX-0.5f)*2);}
  FILE* f = dump? fopen(dump,"wb"):NULL;
  int rowsl[] = {1,2,3,4,6,8};
  for(int ri=0;ri<6;ri++){ int rows=rowsl[ri];
    float* q=malloc(4*rows*heads*d), *out=malloc(4*rows*heads*d);
    for(int i=0;i<rows*heads*d;i++) q[i]=(rand()/(float)RAND_MAX-0.5f)*6;
    uint8_t* vis=calloc(rows*plane,1); for(int r=0;r<rows;r++) memset(vis+r*plane,1,ctx+r+1);
    int32_t rr[1024], hs[1024]; int nq=0;
    for(int g=0;g<kvh;g++) for(int r=0;r<rows;r++) for(int hh=g*(heads/kvh);hh<(g+1)*(heads/kvh);hh++){rr[nq]=r;hs[nq]=hh;nq++;}
    // two threads' split as in step.cpp: queries [0, half) and [half, nq)
    double best1=1e9, best2=1e9; int half=(nq+1)/2;
    for(int it=0;it<reps;it++){
      double t=now(); for(int l=0;l<L;l++) attention(q,heads*d,heads,kvh,d,kc+l*kvh*plane*d,vc+l*kvh*plane*d,plane,vis,plane,0.1f,out,heads*d,rr,hs,nq); t=(now()-t)/L; if(t<best1)best1=t;
      t=now(); for(int l=0;l<L;l++) attention(q,heads*d,heads,kvh,d,kc+l*kvh*plane*d,vc+l*kvh*plane*d,plane,vis,plane,0.1f,out,heads*d,rr,hs,half); t=(now()-t)/L; if(t<best2)best2=t;
    }
    attention(q,heads*d,heads,kvh,d,kc,vc,plane,vis,plane,0.1f,out,heads*d,rr,hs,nq);
    if(f) fwrite(out,4,rows*heads*d,f);
    printf("rows=%d all %6.1f us (%.2f ns/pair)  half %6.1f us\n", rows, best1*1e6, best1*1e9/(nq*(double)ctx), best2*1e6);
    free(q);free(out);free(vis);
  }
  if(f) fclose(f);
}
