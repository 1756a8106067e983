--[[ batch_result: one line of a batch gets its result, once.
KEYS[1] batch results hash   KEYS[2] batch hash
ARGV[1] line number   ARGV[2] the result: one JSON line of the output or error file
ARGV[3] the count to raise: 'completed', 'failed', or '' (a line the batch never ran)
Returns 1 when recorded, 0 when the line already had a result (a restarted job met it again):
a line is counted and written exactly once however often its job is restarted. ]]
if redis.call('HSETNX', KEYS[1], ARGV[1], ARGV[2]) == 0 then
  return 0
end
if ARGV[3] ~= '' then
  redis.call('HINCRBY', KEYS[2], ARGV[3], 1)
end
return 1
