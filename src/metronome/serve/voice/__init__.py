"""The voice stages: workers that know no protocol (`pipeline.VoiceStages` declares them in
order). Hearing turns a turn's audio into words, turn detection turns audio into turn
events, speaking turns a reply's text into PCM; the Realtime session (`serve.realtime`)
renders what they produce as events."""
