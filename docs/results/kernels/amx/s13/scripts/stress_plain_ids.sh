# plain ids of command 1's prompts in many processes, a CPU hog beside half of them; any hash not the reference is printed
REF="['e80d4943', 'fe922150', '5dfbce44', '3209cd48', 'd5abc4fb']"
for i in $(seq 1 40); do
  if [ $((i % 2)) = 0 ]; then python -c "import time; t=time.time()
while time.time()-t < 8: pass" & HOG=$!; fi
  got=$(specdecode generate --draft none --json 2>/dev/null | python -c "
import sys, json, hashlib
ids=[json.loads(l)['token_ids'] for l in sys.stdin if l.startswith('{')]
print([hashlib.sha1(str(i).encode()).hexdigest()[:8] for i in ids])")
  [ -n "$HOG" ] && wait $HOG; HOG=
  if [ "$got" = "$REF" ]; then echo "$i ok"; else echo "$i DIFF $got"; fi
done
echo done
