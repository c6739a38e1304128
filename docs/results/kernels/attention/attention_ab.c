// One attention call (every head of one query row over kv keys) of a qgemm.c, timed and checked against a
// float64 softmax: compiled by run_ab.sh once per source and variant (QGEMM: the source to include).
#include QGEMM
#include <stdio.h>
#include <time.h>
static double now(void){struct timespec t;clock_gettime(CLOCK_MONOTONIC,&t);return t.tv_sec+t.tv_nsec*1e-9;}
int main(int argc,char**argv){
  int heads=atoi(argv[1]),kvh=atoi(argv[2]),d=atoi(argv[3]);int64_t kv=atoll(argv[4]);int reps=atoi(argv[5]);
  int64_t plane=kv+16;
  uint16_t*kc=malloc(2*kvh*plane*d),*vc=malloc(2*kvh*plane*d);float*q=malloc(4*heads*d),*out=malloc(4*heads*d),*scr=malloc(4*plane);
  srand(1);for(int64_t i=0;i<kvh*plane*d;i++){kc[i]=_cvtss_sh((rand()/(float)RAND_MAX-0.5f)*2,0);vc[i]=_cvtss_sh((rand()/(float)RAND_MAX-0.5f)*2,0);}
  for(int i=0;i<heads*d;i++)q[i]=(rand()/(float)RAND_MAX-0.5f)*4;
  double best=1e9;
  for(int r=0;r<reps;r++){double t=now();attention(q,heads,kvh,d,kc,vc,plane,NULL,kv,1.0f/sqrtf(d),scr,out,0,heads);t=now()-t;if(t<best)best=t;}
  // float64 reference for head 0..heads
  double maxerr=0;
  for(int h=0;h<heads;h++){int g=h/(heads/kvh);double*s=malloc(8*kv);double m=-1e300,sum=0;
    for(int64_t j=0;j<kv;j++){double a=0;for(int i=0;i<d;i++)a+=(double)q[h*d+i]/sqrt(d)*_cvtsh_ss(kc[(g*plane+j)*d+i]);s[j]=a;if(a>m)m=a;}
    for(int64_t j=0;j<kv;j++){s[j]=exp(s[j]-m);sum+=s[j];}
    for(int i=0;i<d;i++){double o=0;for(int64_t j=0;j<kv;j++)o+=s[j]*_cvtsh_ss(vc[(g*plane+j)*d+i]);o/=sum;double e=fabs(o-out[h*d+i]);if(e>maxerr)maxerr=e;}
    free(s);}
  printf("%.2f us maxerr %.2e\n",best*1e6,maxerr);
}
